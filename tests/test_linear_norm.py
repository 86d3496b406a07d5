"""The fused projection + residual add + RMSNorm kernel (decode/linear_norm.py) computes the unfused path's
x + linear(a), norm(x + linear(a)) (and with SwiGLU's product as its input), leaves its counts zeroed and gives
the same bits call after call. Triton's interpreter runs it on the CPU in a child process
(conftest.run_interpreted); on CUDA its programs race, and the result must not depend on which finishes last."""

import pytest
import torch
from conftest import interpreted, run_interpreted

pytest.importorskip("triton")


@pytest.mark.slow
@interpreted
def test_kernel_equals_the_unfused_projection_add_and_norm():
    """o_proj-like (K = N = 576) and down_proj-like (K = 3,072 as the packed gate/up halves) products over 1, 8
    and 16 rows, float32 and float16, Llama's and Gemma's norm roundings, a width that is not a multiple of the
    column tile."""
    run_interpreted("""
        import torch
        import torch.nn.functional as F
        from dflash_train.decode import arrivals, fused_target, linear_norm
        from dflash_train.models.drafter import RMSNorm

        torch.manual_seed(0)
        counts = arrivals.counters(1, torch.device("cpu"))
        for n, k, swiglu in ((576, 576, False), (576, 3072, True), (200, 300, True)):
            for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
                norm = RMSNorm(n, 1e-5)
                norm.weight.data = 1 + 0.1 * torch.randn(n)
                norm = norm.to(dtype)
                w = (torch.randn(n, k) / k**0.5).to(dtype)
                for rows in (1, 8, 16):
                    x = torch.randn(1, rows, n, dtype=dtype)
                    gate_up = torch.randn(1, rows, 2 * k, dtype=dtype)
                    a, up = gate_up.chunk(2, dim=-1) if swiglu else (gate_up[..., :k].contiguous(), None)
                    for kind in ("llama", "gemma"):
                        got_x, got_h = linear_norm.linear_add_norm(a, w, x, norm, counts, up=up, kind=kind)
                        inp = fused_target.silu_mul(a, up) if swiglu else a
                        want_x, want_h = fused_target.add_rms_norm(x, F.linear(inp, w), norm, True, kind=kind)
                        for got, want in ((got_x, want_x), (got_h, want_h)):
                            err = ((got.float() - want.float()).abs() / (1 + want.float().abs())).max().item()
                            assert got.dtype == dtype and err < tol, (n, k, swiglu, dtype, rows, kind, err)
                        again = linear_norm.linear_add_norm(a, w, x, norm, counts, up=up, kind=kind)
                        assert torch.equal(again[0], got_x) and torch.equal(again[1], got_h)
                        assert not counts.any()
        """)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_result_does_not_depend_on_which_program_finishes_last():
    """On the GPU, 864 programs race to finish: calls alternating between two inputs, eager or replayed as a CUDA
    graph, each give their input's bits (a last program reading a stale part, left by the other input's call,
    would not), within bf16 rounding of the unfused path."""
    import torch.nn.functional as F

    from dflash_train.decode import arrivals, fused_target, linear_norm
    from dflash_train.models.drafter import RMSNorm

    torch.manual_seed(3)
    dev, dt, n, k = torch.device("cuda"), torch.bfloat16, 576, 3072
    norm = RMSNorm(n, 1e-5).to(dev, dt)
    w = (torch.randn(n, k, device=dev) / k**0.5).to(dt)
    inputs = [(torch.randn(1, 8, n, device=dev, dtype=dt), torch.randn(1, 8, 2 * k, device=dev, dtype=dt))
              for _ in range(2)]
    counts = arrivals.counters(1, dev)
    wants = [linear_norm.linear_add_norm(gu.chunk(2, -1)[0], w, x, norm, counts, up=gu.chunk(2, -1)[1])
             for x, gu in inputs]
    for (x, gu), want in zip(inputs, wants, strict=True):
        ref = fused_target.add_rms_norm(x, F.linear(fused_target.silu_mul(*gu.chunk(2, -1)), w), norm, True)
        assert (want[1].float() - ref[1].float()).abs().max().item() < 0.1
    for i in range(100):
        x, gu = inputs[i % 2]
        got = linear_norm.linear_add_norm(gu.chunk(2, -1)[0], w, x, norm, counts, up=gu.chunk(2, -1)[1])
        assert torch.equal(got[0], wants[i % 2][0]) and torch.equal(got[1], wants[i % 2][1])
    x, gu = (t.clone() for t in inputs[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_norm.linear_add_norm(gu.chunk(2, -1)[0], w, x, norm, counts, up=gu.chunk(2, -1)[1])
    for i in range(100):
        x.copy_(inputs[i % 2][0])
        gu.copy_(inputs[i % 2][1])
        out[0].zero_()
        out[1].zero_()
        graph.replay()
        assert torch.equal(out[0], wants[i % 2][0]) and torch.equal(out[1], wants[i % 2][1])
    assert not counts.any()


def test_a_decode_cache_holds_counts_only_with_split_reduce(monkeypatch):
    """DFLASH_TRAIN_SPLIT_REDUCE decides whether a decode cache holds the split kernels' counts (zeroed, one a
    (row, KV head) at least): without them span attention merges in a kernel of its own and no layer tail runs."""
    from dflash_train.decode.static_lm import StaticCache

    def allocate():
        return StaticCache.allocate(2, 300, 3, 64, 16, torch.float32, torch.device("cpu"))

    monkeypatch.delenv("DFLASH_TRAIN_SPLIT_REDUCE", raising=False)  # on by default
    counts = allocate().counters
    assert counts.dtype == torch.int32 and counts.numel() >= 900 and not counts.any()
    monkeypatch.setenv("DFLASH_TRAIN_SPLIT_REDUCE", "1")
    assert allocate().counters is not None
    monkeypatch.setenv("DFLASH_TRAIN_SPLIT_REDUCE", "0")
    assert allocate().counters is None
