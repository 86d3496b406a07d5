"""The fused q/k/v projection + q/k norms + RoPE + K/V write kernel (decode/linear_rope.py) computes what the GEMM
followed by fused_target.rope_store_ (the target's layers) or fused_drafter.norm_rope_store_ (the drafter's, with
the q/k norms and rows not written) computes, leaves its counts zeroed and gives the same bits call after call.
Triton's interpreter runs it on the CPU in a child process (conftest.run_interpreted); on CUDA its programs race,
and the result must not depend on which finishes last."""

import textwrap

import pytest
import torch
from conftest import interpreted, run_interpreted

pytest.importorskip("triton")

_SETUP = """
    import torch
    import torch.nn.functional as F
    from dflash_train.decode import arrivals, fused_drafter, fused_target, linear_rope
    from dflash_train.models.drafter import RMSNorm

    HEADS, KV, D, WIDTH, SLOTS = 9, 3, 64, 576, 40  # SmolLM2-135M's attention

    def case(b, m, dtype, device, seed):
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(b, m, WIDTH, generator=g).to(device, dtype)
        angle = 6 * torch.rand(b, m, D // 2, generator=g)
        cos, sin = (torch.cat([f(angle)] * 2, -1).to(device, dtype) for f in (torch.cos, torch.sin))
        slots = torch.stack([torch.randperm(SLOTS, generator=g)[:m] for _ in range(b)]).to(device, torch.int32)
        return h, cos, sin, slots

    def reference(h, qkv, cos, sin, slots, queries, norms):
        b, m, _ = h.shape
        caches = [torch.zeros(b, KV, SLOTS, D, dtype=h.dtype, device=h.device) for _ in range(2)]
        q, k, v = F.linear(h, qkv).split([HEADS * D, KV * D, KV * D], -1)
        if norms is None:  # the target's path: every row's queries, every row written
            qs = q.reshape(b, m, HEADS, D).clone()
            fused_target.rope_store_(qs, k.view(b, m, KV, D), v.view(b, m, KV, D), cos, sin, *caches, slots)
            return qs.transpose(1, 2), caches
        qs = fused_drafter.norm_rope_store_(q[:, m - queries:], k, v, *norms, cos, sin, *caches, slots)
        return qs, caches

    def fused(h, qkv, cos, sin, slots, queries, norms, counts):
        b = h.shape[0]
        caches = [torch.zeros(b, KV, SLOTS, D, dtype=h.dtype, device=h.device) for _ in range(2)]
        q_norm, k_norm = norms or (None, None)
        qs = linear_rope.project_rope_store(h, qkv, HEADS, cos, sin, *caches, slots, counts, queries=queries,
                                            q_norm=q_norm, k_norm=k_norm)
        return qs, caches
"""


@pytest.mark.slow
@interpreted
def test_kernel_equals_the_gemm_then_the_rope_and_store_kernels():
    """A target token (1 row), a 4-token verify, two sequences of 4, and the drafter's 8 context + 8 block rows
    with the q/k norms and a context row not written (slot -1); float32 and float16."""
    run_interpreted(_SETUP + """
    counts = arrivals.counters(1, torch.device("cpu"))
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
        qkv = (torch.randn((HEADS + 2 * KV) * D, WIDTH) / WIDTH**0.5).to(dtype)
        norms = [RMSNorm(D, 1e-6) for _ in range(2)]
        for norm in norms:
            norm.weight.data = 1 + 0.1 * torch.randn(D)
        norms = tuple(norm.to(dtype) for norm in norms)
        for b, m, queries, normed in ((1, 1, 1, False), (1, 4, 4, False), (2, 4, 4, False), (1, 16, 8, True),
                                      (1, 4, 4, True)):
            h, cos, sin, slots = case(b, m, dtype, "cpu", m)
            if normed:
                slots[0, 1] = -1  # a rejected context row: not written
            args = (h, qkv, cos, sin, slots, queries, norms if normed else None)
            want_q, want_caches = reference(*args)
            got_q, got_caches = fused(*args, counts)
            assert got_q.shape == want_q.shape and got_q.stride() == want_q.stride(), (got_q.shape, want_q.shape)
            for got, want in ((got_q, want_q), *zip(got_caches, want_caches, strict=True)):
                err = ((got.float() - want.float()).abs() / (1 + want.float().abs())).max().item()
                assert got.dtype == dtype and err < tol, (dtype, b, m, normed, err)
            written = got_caches[0].abs().sum((1, 3)) != 0  # [b, slots]
            assert written.sum() == (slots >= 0).sum(), (written.sum(), slots)
            again = fused(*args, counts)
            assert torch.equal(again[0], got_q) and all(map(torch.equal, again[1], got_caches))
            assert not counts.any()
    """)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_result_does_not_depend_on_which_program_finishes_last():
    """On the GPU, 135 programs race to finish: calls alternating between two inputs, eager or replayed as a CUDA
    graph, each give their input's bits, within bf16 rounding of the GEMM then rope_store_."""
    namespace = {}
    exec(textwrap.dedent(_SETUP), namespace)  # noqa: S102 - the setup shared with the interpreted test
    case, reference, fused = namespace["case"], namespace["reference"], namespace["fused"]
    from dflash_train.decode import arrivals

    torch.manual_seed(3)
    dev, dt = torch.device("cuda"), torch.bfloat16
    qkv = (torch.randn((9 + 6) * 64, 576, device=dev) / 24).to(dt)
    inputs = [case(1, 8, dt, dev, seed) for seed in (1, 2)]  # (h, cos, sin, slots)
    counts = arrivals.counters(1, dev)

    def run(h, cos, sin, slots):
        return fused(h, qkv, cos, sin, slots, 8, None, counts)

    wants = [run(*x) for x in inputs]
    for (h, cos, sin, slots), want in zip(inputs, wants, strict=True):
        ref_q, ref_caches = reference(h, qkv, cos, sin, slots, 8, None)
        assert (want[0].float() - ref_q.float()).abs().max().item() < 0.1
        assert (want[1][0].float() - ref_caches[0].float()).abs().max().item() < 0.1
    for i in range(100):
        got = run(*inputs[i % 2])
        assert torch.equal(got[0], wants[i % 2][0]) and all(map(torch.equal, got[1], wants[i % 2][1]))
    bufs = [t.clone() for t in inputs[0]]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(*bufs)
    for i in range(100):
        for buf, new in zip(bufs, inputs[i % 2], strict=True):
            buf.copy_(new)
        for t in (out[0], *out[1]):
            t.zero_()
        graph.replay()
        assert torch.equal(out[0], wants[i % 2][0]) and all(map(torch.equal, out[1], wants[i % 2][1]))
    assert not counts.any()
