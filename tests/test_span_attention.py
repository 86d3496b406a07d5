"""The span-attention kernel (decode/span_attention.py) computes the batched-matmul path's attention, a query's
output does not depend on the step's other queries, and DFlash decoding through it (the target's token and
verify steps, the drafter's block) gives the PyTorch math's tokens. Triton's interpreter runs the kernel on the
CPU in a child process (conftest.run_interpreted)."""

import pytest
import torch
from conftest import interpreted, run_interpreted

from dflash_train.decode import arrivals
from dflash_train.decode import span_attention as sa

triton = pytest.importorskip("triton")


@pytest.mark.slow
@interpreted
def test_kernel_equals_the_batched_matmul_attention():
    """Causal spans (a token step, an 8-token verify, a 16-token block of 4 groups; Gemma 3's 256-wide heads,
    whose tiles hold fewer slots, and Qwen3's 128-wide ones), windows within a tile and across tiles, sink logits,
    float32 and float16, queries in the transposed layout the projections give; slots before the first span's
    tile and past the last span are never read (NaN there changes nothing). Split into a program a tile, the
    tiles' sums merged by a second kernel or by each (row, KV head)'s last program give the same bits."""
    run_interpreted("""
        import torch
        from dflash_train.decode import arrivals, span_attention as sa
        from dflash_train.decode.static_lm import Mask, cached_attention

        torch.manual_seed(0)
        for b, H, hkv, d, C, n in ((1, 9, 3, 64, 200, 8), (1, 9, 3, 64, 200, 1), (2, 4, 1, 16, 100, 5),
                                   (1, 8, 2, 32, 300, 16), (1, 4, 1, 256, 150, 8), (1, 8, 2, 128, 150, 4)):
            for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
                for window, sinks in ((None, None), (7, None), (70, None), (None, 2 * torch.randn(H))):
                    q = torch.randn(b, n, H, d, dtype=dtype).transpose(1, 2)
                    k, v = (torch.randn(b, hkv, C, d, dtype=dtype) for _ in range(2))
                    hi = torch.stack([torch.arange(n) + 60 + 17 * i for i in range(b)]) + 1
                    lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
                    slots = torch.arange(C)[None, None]
                    seen = (slots >= lo[..., None]) & (slots < hi[..., None])
                    mask = Mask.of(seen, H // hkv, sinks is not None)
                    want = cached_attention(q.float(), k.float(), v.float(), mask, 0.125, sinks)
                    got = sa.span_attention(q, k, v, lo, hi, 0.125, sinks)
                    split = sa.span_attention(q, k, v, lo, hi, 0.125, sinks, kv_len=C)  # a program a tile
                    assert (split.float() - want).abs().max().item() < atol, (b, n, dtype, window, "split")
                    counts = arrivals.counters(b * hkv, q.device)  # the last program of each (row, KV head) merges
                    for _ in range(2):  # and leaves its count zeroed for the next call
                        last = sa.span_attention(q, k, v, lo, hi, 0.125, sinks, kv_len=C, counters=counts)
                        assert torch.equal(last, split) and not counts.any(), (b, n, dtype, window, "last merges")
                    assert got.shape == want.shape and got.dtype == dtype and got.transpose(1, 2).is_contiguous()
                    err = (got.float() - want).abs().max().item()
                    assert err < atol, (b, n, dtype, window, err)
                    first = int(lo.min()) // sa.tile_slots(d) * sa.tile_slots(d)  # the first tile read
                    k[:, :, :first], v[:, :, :first] = float("nan"), float("nan")
                    k[:, :, int(hi.max()):], v[:, :, int(hi.max()):] = float("nan"), float("nan")
                    assert torch.equal(sa.span_attention(q, k, v, lo, hi, 0.125, sinks), got)
                    assert torch.equal(sa.span_attention(q, k, v, lo, hi, 0.125, sinks, kv_len=C), split)
        """)


@pytest.mark.slow
@interpreted
def test_a_query_reads_the_same_tiles_whatever_the_other_queries_see():
    """A step's last query gets the same output, bit for bit in float16, whether the step's first query reaches
    back into an earlier tile or not: tiles start at multiples of the tile size, and a tile a query does not see
    leaves its sums exactly as they were. Split into a program a tile, the output does not depend on the key
    bucket either."""
    run_interpreted("""
        import torch
        from dflash_train.decode import span_attention as sa

        torch.manual_seed(1)
        H, hkv, d, C = 9, 3, 64, 300
        k, v = (torch.randn(1, hkv, C, d, dtype=torch.float16) for _ in range(2))
        q = torch.randn(1, H, 5, d, dtype=torch.float16)
        hi = torch.arange(128, 133)[None] + 1
        lo = torch.full_like(hi, 67)  # tile 1 on
        near = sa.span_attention(q, k, v, lo, hi, 0.125)
        lo[0, 0] = 63  # the first query reaches into tile 0
        far = sa.span_attention(q, k, v, lo, hi, 0.125)
        assert not torch.equal(near[:, :, 0], far[:, :, 0])
        assert torch.equal(near[:, :, 1:], far[:, :, 1:])
        # a program a tile (kv_len: 2 and 3 tiles): the key bucket does not change a bit, nor the first query
        split = [sa.span_attention(q, k, v, lo, hi, 0.125, kv_len=n) for n in (134, C)]
        assert torch.equal(split[0], split[1])
        lo[0, 0] = 67
        assert torch.equal(sa.span_attention(q, k, v, lo, hi, 0.125, kv_len=C)[:, :, 1:], split[0][:, :, 1:])
        """)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_verify_query_gets_what_a_token_step_gets():
    """On the GPU a query's rows do not mix with the others' in the tile products: the last query of an 8-token
    verify (24 rows) gets, bit for bit in bf16, what it gets alone (3 rows), windowed or not, split into a program
    a tile or not, whatever key bucket each step has."""
    torch.manual_seed(1)
    dev, H, hkv, d, C = torch.device("cuda"), 9, 3, 64, 1024
    k, v = (torch.randn(1, hkv, C, d, dtype=torch.bfloat16, device=dev) for _ in range(2))
    q = torch.randn(1, 8, H, d, dtype=torch.bfloat16, device=dev).transpose(1, 2)
    hi = torch.arange(600, 608, device=dev)[None] + 1
    for window in (None, 70):
        lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
        for kv_len in (None, 640, 1024):  # one program a (row, KV head), or one a tile: verify 640, token 1024
            step = sa.span_attention(q, k, v, lo, hi, 0.125, kv_len=kv_len and 640)
            alone = sa.span_attention(q[:, :, -1:], k, v, lo[:, -1:], hi[:, -1:], 0.125, kv_len=kv_len)
            assert torch.equal(step[:, :, -1:], alone), (window, kv_len)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_each_last_program_merges_what_the_merge_kernel_does():
    """On the GPU, where a (row, KV head)'s tile programs race to finish, the last one merges their sums bit for
    bit as the merge kernel does, for calls alternating between two inputs (a stale part left by the other
    input's call would show), eagerly and replayed as a CUDA graph; every call leaves its counts zeroed:
    2 rows x 3 KV heads x 8 tiles."""
    torch.manual_seed(2)
    dev, H, hkv, d, C = torch.device("cuda"), 9, 3, 64, 1024
    hi = torch.stack([torch.arange(900, 908), torch.arange(1000, 1008)]).to(dev) + 1
    lo = torch.zeros_like(hi)
    inputs = [(torch.randn(2, 8, H, d, dtype=torch.bfloat16, device=dev).transpose(1, 2),
               *(torch.randn(2, hkv, C, d, dtype=torch.bfloat16, device=dev) for _ in range(2))) for _ in range(2)]
    wants = [sa.span_attention(q, k, v, lo, hi, 0.125, kv_len=C) for q, k, v in inputs]
    counts = arrivals.counters(2 * hkv, dev)
    for i in range(100):
        q, k, v = inputs[i % 2]
        assert torch.equal(sa.span_attention(q, k, v, lo, hi, 0.125, kv_len=C, counters=counts), wants[i % 2])
    q, k, v = (t.clone() for t in inputs[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sa.span_attention(q, k, v, lo, hi, 0.125, kv_len=C, counters=counts)
    for i in range(100):
        for dst, src in zip((q, k, v), inputs[i % 2], strict=True):
            dst.copy_(src)
        out.zero_()
        graph.replay()
        assert torch.equal(out, wants[i % 2])
    assert not counts.any()


@pytest.mark.slow
@interpreted
def test_dflash_decoding_through_the_kernel_gives_the_pytorch_tokens():
    """A T=0 DFlash decode of the tiny target with a sliding-layer drafter: through the span kernel, the fused
    K/V writes and the fused layer tails (the target's prefill stays on SDPA) and through the PyTorch math, the
    same tokens and acceptances in float32, and the kernels ran in both the target's and the drafter's steps."""
    out = run_interpreted("""
        import os
        os.environ["DFLASH_TRAIN_SPLIT_REDUCE"] = "1"  # the split kernels' last programs reduce (arrivals.py)
        import torch
        from dflash_train.decode import generate as gen, greedy_loop, linear_norm, linear_rope, span_attention as sa
        from dflash_train.decode import static_drafter
        from dflash_train.decode import static_lm
        from dflash_train.decode.speculative import speculative_generate
        from dflash_train.models.factory import drafter_config_for, new_drafter
        from dflash_train.models.loading import load_target

        target = load_target("random:tiny", device="cpu", dtype=torch.float32, seed=0)
        cfg = drafter_config_for(target, num_layers=2, block_size=4, num_sliding_layers=1, sliding_window=6,
                                 dtype="float32")
        drafter = new_drafter(cfg, 1).float().eval()
        embed, head = target.model.get_input_embeddings(), target.lm_head
        prompt = torch.randint(0, 200, (21,), generator=torch.Generator().manual_seed(2)).tolist()
        runs = []
        calls = []  # (query tokens, the K cache's storage) of every kernel call
        kernel = sa.span_attention
        sa.span_attention = lambda *a, **k: calls.append((a[0].shape[2], a[1].data_ptr())) or kernel(*a, **k)
        tails = set()  # the rows of every linear_norm.layer_tail call
        tail = linear_norm.layer_tail
        linear_norm.layer_tail = lambda *a, **k: tails.add(a[0].shape[1]) or tail(*a, **k)
        projections = set()  # the rows of every linear_rope.project_rope_store call
        project = linear_rope.project_rope_store
        linear_rope.project_rope_store = lambda *a, **k: projections.add(a[0].shape[1]) or project(*a, **k)
        for fast in (False, True):
            greedy_loop.release(drafter)
            static_lm.use(static_lm.StaticLM(target.model, attention_kernel=fast, fused=fast))
            static_drafter._INSTANCES[drafter] = static_drafter.StaticDrafter(drafter, embed, head, fused=fast,
                                                                              spans=fast)
            runs.append(speculative_generate(target, drafter, prompt, 24))
        assert runs[0].tokens == runs[1].tokens, runs
        assert runs[0].accepted == runs[1].accepted
        # the target-only baseline's one-token steps through the kernel: its greedy tokens, which DFlash's equal
        plain = static_lm.StaticLM(target.model, attention_kernel=False, fused=False)
        fast = static_lm.StaticLM(target.model)
        alone = [gen.generate(lm, [prompt], 24, []).rows[0] for lm in (plain, fast)]
        assert alone[0] == alone[1] == runs[1].tokens[:len(alone[0])], (alone, runs[1].tokens)
        loop = greedy_loop.for_pair(target, drafter)
        target_keys = {t.data_ptr() for cache in (loop.caches[0], fast._cache) for t in cache.keys}
        draft_keys = {t.data_ptr() for t in loop.caches[1].keys}
        print(*(sorted({n for n, key in calls if key in keys}) for keys in (target_keys, draft_keys)))
        print(sorted(tails), sorted(projections))
        """)
    # the target's one-token steps and 4-token verifies (its prefills stay on SDPA); the drafter's prefix pass
    # (1 query) and its blocks; the layers' tails through linear_norm in the same steps, their q/k/v through
    # linear_rope (the drafter's: the 4 context rows and the 4-slot block)
    assert out.split("] [") == ["[1, 4", "1, 4]\n[1, 4", "1, 4, 8]\n"], out


@pytest.mark.slow
@interpreted
def test_the_fused_kv_writes_equal_rope_and_scatter():
    """rope_store_ (RoPE on q in place, k rotated and k, v into the cache at their positions) against rope and
    scatter_; the drafter's norm_rope_store_ against eager_norm_rope and index_copy_, on rows of a packed
    projection, rows with a negative slot left alone; head widths whose halves are
    not powers of two (24, 80) included."""
    run_interpreted("""
        import torch
        from dflash_train.decode import fused_drafter as fd, fused_target as ft
        from dflash_train.models import fused
        from dflash_train.models.drafter import RMSNorm

        torch.manual_seed(0)
        for d in (16, 24, 80):
            b, n, H, hkv = 2, 5, 6, 2
            qs, ks, vs = (torch.randn(b, n, h, d) for h in (H, hkv, hkv))
            cos, sin = torch.randn(b, n, d), torch.randn(b, n, d)
            pos = torch.stack([torch.arange(n) + 3, torch.arange(n) + 20])
            kc, vc = torch.randn(b, hkv, 40, d), torch.randn(b, hkv, 40, d)
            want_k, want_v = kc.clone(), vc.clone()
            idx = pos[:, None, :, None].expand(b, hkv, n, d)
            want_k.scatter_(2, idx, ft.rope(ks, cos, sin).transpose(1, 2))
            want_v.scatter_(2, idx, vs.transpose(1, 2))
            got_q = qs.clone()
            ft.rope_store_(got_q, ks, vs, cos, sin, kc, vc, pos)
            assert torch.equal(got_q, ft.rope(qs, cos, sin)), d
            assert torch.equal(kc, want_k) and torch.equal(vc, want_v), d
            # the drafter's: q/k norm and RoPE on rows of a packed projection, K/V rows with a negative slot skipped
            qkv = torch.randn(b, n, (H + 2 * hkv) * d)
            q_rows, k_rows, v_rows = qkv[:, 2:, :H * d], qkv[:, :, H * d:(H + hkv) * d], qkv[:, :, (H + hkv) * d:]
            q_norm, k_norm = (RMSNorm(d, 1e-6) for _ in range(2))
            for norm in (q_norm, k_norm):
                norm.weight.data = torch.randn(d)
            slots = torch.tensor([[7, -1, 9, 10, 11], [0, 1, -1, -1, 30]])
            want_k, want_v = kc.clone(), vc.clone()
            k = fused.eager_norm_rope(k_rows.reshape(b, n, hkv, d), k_norm.weight, 1e-6, cos, sin)
            for i in range(b):
                keep = slots[i] >= 0
                want_k[i].index_copy_(1, slots[i][keep], k[i][keep].transpose(0, 1))
                want_v[i].index_copy_(1, slots[i][keep], v_rows[i][keep].reshape(-1, hkv, d).transpose(0, 1))
            got_q = fd.norm_rope_store_(q_rows, k_rows, v_rows, q_norm, k_norm, cos, sin, kc, vc, slots)
            want_q = fused.eager_norm_rope(q_rows.reshape(b, 3, H, d), q_norm.weight, 1e-6, cos[:, 2:], sin[:, 2:])
            torch.testing.assert_close(got_q, want_q.transpose(1, 2), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(kc, want_k, rtol=1e-6, atol=1e-6)
            assert torch.equal(vc, want_v), d
        """)


@pytest.mark.slow
@interpreted
def test_the_accept_kernel_takes_the_tensor_ops_steps():
    """greedy_accept's one-kernel acceptance advances the device loop's state as its tensor ops do: no draft
    accepted, some, all, a block cut short by the token limit (its later drafts never count), the last step
    before the limit."""
    run_interpreted("""
        import copy
        import torch
        from dflash_train.decode.greedy_accept import LoopState, accept_

        B = 8
        pred = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
        for draft, width, limit in (([1] * 7, 8, 100), ([5, 6, 7, 0, 9, 10, 11], 8, 100), (pred[:7].tolist(), 8, 100),
                                    (pred[:7].tolist(), 3, 100), (pred[:7].tolist(), 8, 16), ([5, 6] + [0] * 5, 8, 13)):
            s = LoopState(torch.zeros(1, B, 4), torch.tensor([40, 3, width]), torch.full((1, B), 99),
                          torch.tensor([[4] + draft]), torch.zeros(1, B, dtype=torch.long), torch.tensor(9),
                          torch.tensor(limit), torch.tensor([2]), torch.zeros(5, 1 + B, dtype=torch.long))
            runs = []
            for kernel in (False, True):
                state = copy.deepcopy(s)
                accept_(pred, state, kernel=kernel)
                runs.append(state)
            eager, fused = runs
            for name in ("meta", "block", "verify", "pos", "count", "step", "records"):
                assert torch.equal(getattr(eager, name), getattr(fused, name)), (name, draft, width, limit)
            assert eager.step.item() == 3 and eager.records[2, 1:].tolist() == pred.tolist()
        """)
