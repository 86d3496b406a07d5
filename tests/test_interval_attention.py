"""The interval attention kernels (models/interval_attention.py, --attention intervals) against the dense
predicate: the attention and its three gradients, the DFlash loss and a drafter's gradients, and compiled draft
layers calling the custom ops. Triton's interpreter runs the kernels on the CPU in a child process
(conftest.run_interpreted)."""

import shutil

import pytest
import torch
from conftest import interpreted, run_interpreted

from dflash_train.errors import UsageError
from dflash_train.models.interval_attention import dkdv_tile_table
from dflash_train.objective.masks import MaskSpec, dense_mask, row_intervals
from dflash_train.objective.objective import ObjectiveConfig, check_backend_device, check_backend_heads

pytest.importorskip("triton")


def test_key_tiles_name_every_query_tile_that_sees_them():
    """Each key tile's query-tile range covers every query row that may attend to one of its keys (the dK/dV
    kernel walks only that range), on a pack of four sequences with and without a window."""
    lens, B = [37, 5, 60, 22], 4
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    anchors = torch.tensor([0, 3, 20, 36, 38, 41, 50, 90, 101, 110, 120])
    for window in (None, 5):
        spec = MaskSpec(seq, pos, anchors, B, window)
        dense = dense_mask(spec)[0, 0]  # [Q, S + Q]
        rows = row_intervals(seq, pos, anchors, B, window)
        for bm, bn in ((8, 8), (16, 32), (64, 64)):
            nkv = -(-dense.shape[1] // bn)
            ranges = dkdv_tile_table(rows, dense.shape[1], bm, bn)[:2 * nkv].view(2, nkv)
            for t in range(nkv):
                seen_by = dense[:, t * bn:(t + 1) * bn].any(1).nonzero().flatten()
                if seen_by.numel():
                    assert ranges[0, t] * bm <= seen_by.min() and seen_by.max() < ranges[1, t] * bm, (window, t)


def test_the_interval_kernels_are_refused_off_cuda_and_for_heads_they_do_not_take():
    with pytest.raises(UsageError, match="--attention intervals: its kernels run on CUDA"):
        check_backend_device(ObjectiveConfig(attention="intervals").attention, torch.device("cpu"))
    for head_dim in (64, 128, 16):
        check_backend_heads("intervals", head_dim)
    check_backend_heads("flex", 256)
    for head_dim in (256, 96, 8):  # Gemma 3's, not a power of two, too narrow for a tensor-core dot
        with pytest.raises(UsageError, match=f"--attention intervals: .* not the drafter's {head_dim}; use"):
            check_backend_heads("intervals", head_dim)


@pytest.mark.slow
@interpreted
def test_kernels_equal_the_dense_attention_and_its_gradients():
    """Output and dQ, dK, dV against SDPA over the dense mask in float32: two packed sequences, the context padded
    past them (pads no query sees), windows inside and beyond a block, GQA, queries in o_proj's layout, and the
    output written in it; float16 to its rounding. Small tiles too, where some context tiles lie inside every
    row's interval (walked unmasked) and a query tile's blocks span both sequences."""
    run_interpreted("""
        import torch
        import torch.nn.functional as F
        from dflash_train.models.attention import repeat_kv
        from dflash_train.models.interval_attention import IntervalMask, Launch, interval_attention
        from dflash_train.objective.masks import MaskSpec, dense_mask, row_intervals

        torch.manual_seed(0)
        lens, S = [70, 50], 128
        seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)] + [torch.full((S - sum(lens),), -1)])
        pos = torch.cat([torch.arange(n) for n in lens] + [torch.zeros(S - sum(lens), dtype=torch.long)])
        anchors = torch.tensor([0, 3, 10, 11, 40, 67, 71, 90, 115])
        for B, H, hkv, d, window in ((8, 6, 2, 32, None), (8, 6, 2, 32, 5), (4, 4, 4, 16, 12), (8, 2, 1, 128, None)):
            spec = MaskSpec(seq, pos, anchors, B, window)
            Q, M = spec.num_queries, S + spec.num_queries
            rows = row_intervals(seq, pos, anchors, B, window)
            small = [IntervalMask.of(rows, M, d, (Launch(16, 16), Launch(32, 16), Launch(16, 32))),
                     IntervalMask.of(rows, M, d, (Launch(32, 16), Launch(16, 16), Launch(16, 16)))]
            if window is None and B == 8:  # some 16-row tile sees a whole 16-key context tile
                lo, hi = rows[0].tolist(), rows[1].tolist()
                assert any(-(-max(lo[i:i + 16]) // 16) * 16 + 16 <= min(hi[i:i + 16]) for i in range(0, Q, 16))
            for mask, dtype, atol in [(IntervalMask.of(rows, M, d), torch.float32, 2e-5),
                                      (IntervalMask.of(rows, M, d), torch.float16, 4e-3),
                                      *((m, torch.float32, 2e-5) for m in small if d <= 32)]:
                q = torch.randn(1, Q, H, d, dtype=dtype).transpose(1, 2).requires_grad_()
                k, v = (torch.randn(1, hkv, M, d, dtype=dtype).requires_grad_() for _ in range(2))
                grad = torch.randn(1, H, Q, d, dtype=dtype)
                out = interval_attention(q, k, v, mask, d ** -0.5)
                assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()
                out.backward(grad)
                ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
                want = F.scaled_dot_product_attention(ref[0], *repeat_kv(*ref), attn_mask=dense_mask(spec),
                                                      scale=d ** -0.5)
                want.backward(grad.float())
                for name, got, exp in zip("oqkv", (out, q.grad, k.grad, v.grad), (want, *(t.grad for t in ref))):
                    err = (got.float() - exp).abs().max().item()
                    assert err < atol * max(1.0, exp.abs().max().item()), (B, d, window, dtype, mask.launch, name, err)
        """)


@pytest.mark.slow
@interpreted
def test_intervals_give_the_dense_loss_and_gradients_compiled_once_per_layer_kind():
    """A 2-layer drafter (one sliding layer) on packs of three shapes: --attention intervals gives the dense
    backend's loss and parameter gradients, eagerly and with its layers compiled (the custom ops inside the
    graphs: one graph per layer kind over the three packs)."""
    run_interpreted("""
        import torch
        import torch._dynamo
        from torch._dynamo.utils import counters
        from dflash_train.models.factory import drafter_config_for, new_drafter
        from dflash_train.models.loading import load_target
        from dflash_train.objective.anchors import sample_packed_anchors
        from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig
        from test_objective import _packed

        target = load_target("random:tiny", device="cpu", dtype=torch.float32, seed=0)
        cfg = drafter_config_for(target, num_layers=2, block_size=4, dtype="float32", num_sliding_layers=1,
                                 sliding_window=5)

        def run(backend, compiled=False):
            drafter = new_drafter(cfg, 1).float()
            obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head,
                                  ObjectiveConfig(attention=backend, loss_chunk_rows=7))
            out = []
            with drafter.compiled_layers(compiled, backend="aot_eager"):
                for seed, lens in enumerate([(13, 9, 11), (20, 7), (5, 17, 9, 12)]):
                    b = _packed(lens, seed)
                    anchors = sample_packed_anchors(b, 4, torch.Generator().manual_seed(seed))
                    drafter.zero_grad()
                    feats = torch.randn(b.num_tokens, 3 * 64, generator=torch.Generator().manual_seed(seed))
                    loss = obj(b, anchors, feats).loss
                    loss.backward()
                    out.append((loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
            return out

        want = run("dense")
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            got = run("intervals", compiled)
            if compiled:
                assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
            for (lg, gg), (lw, gw) in zip(got, want):
                torch.testing.assert_close(lg, lw, rtol=1e-5, atol=1e-5)
                for a, b in zip(gg, gw):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        """)


@pytest.mark.slow
@interpreted
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="Inductor's CPU code needs a C compiler")
def test_intervals_under_autocast_in_inductor_graphs_give_the_dense_gradients():
    """Training's case: draft layers compiled by Inductor under half-precision autocast, where q and k come out of
    the float32 q/k norms and v out of its projection in half precision. The kernels run in half precision and
    every gradient returns in its input's dtype, as Inductor's backward graph allocates it. float16 here:
    Triton's interpreter does not compute in bfloat16."""
    run_interpreted("""
        import os
        import tempfile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()  # Inductor's graphs compiled here, not cached ones
        import torch
        from dflash_train.models.factory import drafter_config_for, new_drafter
        from dflash_train.models.loading import load_target
        from dflash_train.objective.anchors import sample_packed_anchors
        from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig
        from test_objective import _packed

        target = load_target("random:tiny", device="cpu", dtype=torch.float32, seed=0)
        cfg = drafter_config_for(target, num_layers=2, block_size=4, dtype="float32", num_sliding_layers=1,
                                 sliding_window=5)

        def run(backend, compiled):
            drafter = new_drafter(cfg, 1).float()
            obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head,
                                  ObjectiveConfig(attention=backend, loss_chunk_rows=7))
            with drafter.compiled_layers(compiled), torch.autocast("cpu", dtype=torch.float16):
                b = _packed((13, 9, 11), 0)
                feats = torch.randn(b.num_tokens, 3 * 64, generator=torch.Generator().manual_seed(0))
                obj(b, sample_packed_anchors(b, 4, torch.Generator().manual_seed(0)), feats).loss.backward()
            return [p.grad for p in drafter.parameters()]

        for got, want in zip(run("intervals", True), run("dense", False)):
            assert got.dtype == want.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3)
        """)
