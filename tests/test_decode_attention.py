"""The decode-attention kernel (decode/attention_kernel.py) computes the batched-matmul path's attention,
and regeneration through it gives the same tokens. Triton's interpreter runs the kernel on the CPU; it is
chosen when triton is imported, so the checks run in a child process with TRITON_INTERPRET=1."""

from pathlib import Path

import pytest
import torch
from conftest import interpreted, run_interpreted

from dflash_train.decode import attention_kernel as da

triton = pytest.importorskip("triton")


@pytest.mark.slow
@interpreted
def test_kernel_equals_the_batched_matmul_attention():
    """Rows of 1 slot, one tile less one, one tile, one more, and the whole cache; 3 query heads per KV head;
    float32 and float16; a cache of more rows and slots than the step's (the compacted batch's views)."""
    run_interpreted("""
        import torch
        from dflash_train.decode import attention_kernel as da
        from dflash_train.decode.static_lm import Mask, cached_attention

        torch.manual_seed(0)
        b, H, hkv, d, C = 5, 9, 3, 64, 160
        lens = torch.tensor([1, 63, 64, 65, 160])
        for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            q = torch.randn(b, H, 1, d, dtype=dtype)
            k, v = (torch.randn(b + 2, hkv, C + 40, d, dtype=dtype)[:b, :, :C] for _ in range(2))
            visible = torch.arange(C)[None, None, :] < lens[:, None, None]
            want = cached_attention(q.float(), k.float(), v.float(), Mask.of(visible, H // hkv), 0.125)
            got = da.decode_attention(q, k, v, lens, 0.125)
            assert got.shape == want.shape and got.dtype == dtype
            err = (got.float() - want).abs().max().item()
            assert err < atol, (dtype, err)
            # the slots past each row's length are never read: garbage there changes nothing
            k2, v2 = k.clone(), v.clone()
            for i, n in enumerate(lens.tolist()):
                k2[i, :, n:], v2[i, :, n:] = float("nan"), float("nan")
            assert torch.equal(da.decode_attention(q, k2, v2, lens, 0.125), got)
        """)


@pytest.mark.slow
@interpreted
def test_regeneration_through_the_kernel_gives_the_batched_matmul_tokens():
    """generate() on the tiny target with the kernel on (its one-token steps, every compaction's views) and
    off: the same tokens at T=0 in float32, and the kernel ran at every layer of every step."""
    out = run_interpreted("""
        import torch
        from dflash_train.decode import attention_kernel as da, generate as gen, static_lm
        from dflash_train.models.loading import load_target

        torch.manual_seed(0)
        target = load_target("random:tiny", device="cpu", dtype=torch.float32, seed=0)
        lm = static_lm.StaticLM(target.model, attention_kernel=False)
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, 256, (3 + 5 * i,), generator=g).tolist() for i in range(4)]
        free = gen.generate(lm, prompts, 10, []).rows
        stops = [free[0][2], free[2][5]]  # rows stop at different steps: compactions
        gen.COMPACT_MIN_ROWS, gen.COMPACT_MIN_SHARE = 1, 0.0
        want = gen.generate(lm, prompts, 10, stops)
        lm = static_lm.StaticLM(target.model)
        da.MIN_PROGRAMS = 1  # the tiny batch would stay on the batched-matmul path
        calls = []
        kernel = da.decode_attention
        da.decode_attention = lambda *a, **k: calls.append(1) or kernel(*a, **k)
        got = gen.generate(lm, prompts, 10, stops)
        assert got.rows == want.rows, (got.rows, want.rows)
        assert got.compactions == want.compactions >= 1
        print(len(calls))
        """)
    steps_layers = int(out.split()[-1])
    assert steps_layers >= 6 * 5  # 6 layers, at least 5 one-token steps


@pytest.mark.slow
@interpreted
def test_a_windowed_kernel_reads_only_the_last_window_slots():
    """A sliding layer's step: each row sees its last `window` slots (fewer in rows shorter than the window),
    as the batched-matmul path with the windowed mask; slots before the window are never read. With sink
    logits (gpt_oss) too."""
    run_interpreted("""
        import torch
        from dflash_train.decode import attention_kernel as da
        from dflash_train.decode.static_lm import Mask, cached_attention

        torch.manual_seed(0)
        b, H, hkv, d, C = 5, 4, 2, 16, 160
        lens = torch.tensor([1, 40, 64, 100, 160])
        slots = torch.arange(C)[None, None, :]
        for window, sinks in ((1, None), (40, None), (65, None), (40, 3 * torch.randn(H)), (None, torch.randn(H))):
            q = torch.randn(b, H, 1, d)
            k, v = torch.randn(b, hkv, C, d), torch.randn(b, hkv, C, d)
            visible = (slots < lens[:, None, None]) & (slots >= lens[:, None, None] - (window or C))
            want = cached_attention(q, k, v, Mask.of(visible, H // hkv, sinks is not None), 0.25, sinks)
            got = da.decode_attention(q, k, v, lens, 0.25, window=window, sinks=sinks)
            assert (got - want).abs().max().item() < 1e-5, window
            for i, n in enumerate(lens.tolist()):
                k[i, :, :max(n - (window or C), 0)], v[i, :, :max(n - (window or C), 0)] = float("nan"), float("nan")
            assert torch.equal(da.decode_attention(q, k, v, lens, 0.25, window=window, sinks=sinks), got)
            if sinks is not None:  # the sinks count: without them the output differs
                assert (da.decode_attention(q, k, v, lens, 0.25, window=window) - got).abs().max() > 1e-3
        """)


@pytest.mark.slow
@interpreted
def test_sliding_targets_through_the_kernels_give_the_pytorch_tokens():
    """Gemma 3, gpt_oss, Mistral and Qwen2 sliding-window targets: regeneration with the decode kernel
    (windowed in the sliding layers, gpt_oss's sinks) and the fused chains (Gemma's and gpt_oss's norm
    roundings included) gives the PyTorch math's tokens, and the fused prefill its logits."""
    run_interpreted(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from sliding_targets import SLIDING_ARCHS, sliding_window_model
        from dflash_train.decode import attention_kernel as da, generate as gen, static_lm

        da.MIN_PROGRAMS = 1  # the tiny batch would stay on the batched-matmul path
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, 256, (3 + 5 * i,), generator=g).tolist() for i in range(4)]
        for arch in SLIDING_ARCHS:
            model = sliding_window_model(arch)
            plain = static_lm.StaticLM(model, attention_kernel=False, fused=False)
            fast = static_lm.StaticLM(model)
            assert fast._fused, arch
            want, got = (gen.generate(lm, prompts, 10, [], lag=0).rows for lm in (plain, fast))
            assert got == want, (arch, got, want)
            ids = torch.tensor([prompts[-1]])
            pos = torch.arange(ids.shape[1])[None]
            a, b = (lm.forward(ids, pos, lm.cache_for(1, 64), 128, prefill=True).logits for lm in (plain, fast))
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        """)


def test_the_kernel_takes_one_token_steps_of_wide_half_precision_batches_on_cuda(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    wide = da.MIN_PROGRAMS // 3
    assert da.applies(wide, 1, 3, 64, torch.bfloat16, cuda)
    assert not da.applies(wide - 1, 1, 3, 64, torch.bfloat16, cuda)  # eval's batch 1 keeps its GEMVs
    assert not da.applies(wide, 8, 3, 64, torch.bfloat16, cuda)  # a verify block
    assert not da.applies(wide, 1, 3, 64, torch.float32, cuda)
    assert not da.applies(wide, 1, 3, 64, torch.float32, cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda_equals_the_batched_matmul_attention_in_bf16():
    """SmolLM2's attention shape at a regeneration batch's width, compiled for the GPU (not interpreted)."""
    from dflash_train.decode.static_lm import Mask, cached_attention

    torch.manual_seed(0)
    b, H, hkv, d, C = 512, 9, 3, 64, 1024
    dev = torch.device("cuda")
    lens = torch.randint(1, C + 1, (b,), device=dev)
    q = torch.randn(b, H, 1, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, C, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    visible = torch.arange(C, device=dev)[None, None, :] < lens[:, None, None]
    want = cached_attention(q.float(), k.float(), v.float(), Mask.of(visible, H // hkv), 0.125)
    got = da.decode_attention(q, k, v, lens, 0.125)
    assert (got.float() - want).abs().max().item() < 2e-2


@pytest.mark.slow
@interpreted
def test_fused_drafter_step_equals_the_eager_step():
    """The drafter's decode step through its Triton kernels (residual adds with their norms, the q/k norms with
    RoPE and the K/V writes) gives the eager step's draft logits, its projections packed or not, attending through
    span_attention or over masks: a prompt's context, then a step that commits part of the last block."""
    run_interpreted("""
        import torch
        from dflash_train.decode.static_drafter import StaticDrafter
        from dflash_train.models.factory import drafter_config_for, new_drafter
        from dflash_train.models.loading import load_target

        # half: the roundings too, up to the order of the norms' sums (a flipped rounding: 1 ulp of the logits)
        for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 5e-4)):
            target = load_target("random:tiny", device="cpu", dtype=dtype, seed=0)
            cfg = drafter_config_for(target, num_layers=2, block_size=4, num_sliding_layers=1, sliding_window=6)
            drafter = new_drafter(cfg, 0, torch.device("cpu")).to(dtype)
            embed, head = target.model.get_input_embeddings(), target.lm_head
            g = torch.Generator().manual_seed(3)
            n_feat = len(drafter.config.target_layer_ids) * target.hidden_size
            steps = [(torch.randn(1, 9, n_feat, generator=g), torch.tensor([0, 9, 4])),
                     (torch.randn(1, 4, n_feat, generator=g), torch.tensor([9, 2, 4]))]
            block = torch.randint(0, 200, (1, 4), generator=g)
            outs = []
            for fused, packed, spans in ((False, False, True), (True, False, True), (True, True, True),
                                         (True, True, False)):
                engine = StaticDrafter(drafter, embed, head, fused=fused, packed=packed, spans=spans)
                assert engine._fused == fused and (engine._packed is not None) == packed
                cache = engine.cache_for(64)
                outs.append([engine.forward(feats, block, meta, cache, 128) for feats, meta in steps])
            for fast in outs[1:]:
                for a, b in zip(outs[0], fast):
                    torch.testing.assert_close(a, b, rtol=0, atol=atol)
        """)


@pytest.mark.slow
@interpreted
def test_fused_target_forward_equals_the_eager_forward():
    """StaticLM with its elementwise chains as Triton kernels (decode/fused_target.py: residual add + RMSNorm,
    RoPE in place, SiLU x up), its projections packed or not (decode/packed.py), gives the eager forward's logits
    and features: a prefill, one-token steps, then 4-token steps (a verify's shape); on a Qwen3 target and on a
    gpt_oss one (biased projections, sink logits, sliding layers, experts)."""
    run_interpreted("""
        import torch
        from dflash_train.decode import static_lm
        from dflash_train.models.loading import load_target

        def outputs(lm, prompts):
            cache = lm.cache_for(3, 64)
            width = max(map(len, prompts))
            ids = torch.zeros(3, width, dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, :len(p)] = torch.tensor(p)
            pos = torch.arange(width).expand(3, width)
            first = lm.forward(ids, pos, cache, static_lm.bucket(width), layers=(1, 5), prefill=True)
            step = lm.step(torch.tensor([[7], [8], [9]]), torch.tensor([[len(p)] for p in prompts]), cache,
                           static_lm.bucket(width + 1), layers=(1, 5))
            at = torch.tensor([[len(p) + 1 + j for j in range(4)] for p in prompts])
            verify = lm.step(torch.arange(12).view(3, 4), at, cache, static_lm.bucket(width + 5), layers=(1, 5))
            return first.logits, first.features, step.logits, step.features, verify.logits, verify.features

        for name in ("random:tiny", "random:tiny-gpt-oss"):
            target = load_target(name, device="cpu", dtype=torch.float32, seed=0)
            g = torch.Generator().manual_seed(4)
            prompts = [torch.randint(0, 256, (3 + 5 * i,), generator=g).tolist() for i in range(3)]
            outs = []
            for fused, packed in ((False, False), (True, False), (True, True)):
                lm = static_lm.StaticLM(target.model, fused=fused, packed=packed)
                assert lm._fused == fused and (lm._packed is not None) == packed
                assert lm._fused_mlp == (name == "random:tiny")
                outs.append(outputs(lm, prompts))
            for fast in outs[1:]:
                for a, b in zip(outs[0], fast):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        """)
