"""The drafter's fused elementwise chains: compiled on CUDA, the same values and gradients as eager."""

import pytest
import torch

from dflash_train.models import fused


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled chains run on CUDA only")
def test_compiled_chains_match_eager_values_and_gradients():
    torch.manual_seed(0)
    dev = "cuda"
    # float32, so the only difference left is the order of float32 operations inside a kernel
    x = torch.randn(2, 96, 4, 64, device=dev, requires_grad=True)
    w = torch.rand(64, device=dev, requires_grad=True)
    cos, sin = torch.randn(2, 96, 64, device=dev), torch.randn(2, 96, 64, device=dev)
    gate = torch.randn(2, 96, 256, device=dev, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)

    def run(rms_norm, norm_rope, swiglu):
        outs = [rms_norm(x.flatten(2), w.repeat(4), 1e-6), norm_rope(x, w, 1e-6, cos, sin), swiglu(gate, up)]
        grads = torch.autograd.grad(sum((o.float() ** 2).sum() for o in outs), [x, w, gate, up])
        return outs, grads

    eager = run(fused.eager_rms_norm, fused.eager_norm_rope, fused.eager_swiglu)
    compiled = run(fused.rms_norm, fused.norm_rope, fused.swiglu)
    assert set(fused._COMPILED) == {"eager_rms_norm", "eager_norm_rope", "eager_swiglu"}
    for a, b in zip(compiled[0] + list(compiled[1]), eager[0] + list(eager[1]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_inside_eager_chains_a_cuda_tensor_gets_the_plain_function_and_nothing_compiles(monkeypatch):
    """The eval runs the chains eagerly: a no-grad forward outside training's autocast would otherwise compile each
    chain again. The switch is undone on exit, and it is per thread."""
    import threading

    class OnCuda:  # _pick asks only whether the tensor is on CUDA
        is_cuda = True

    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setattr(fused, "compile_serialized", lambda fn, dynamic: ("compiled", fn))
    with fused.eager_chains():
        assert fused._pick(fused.eager_rms_norm, OnCuda()) is fused.eager_rms_norm
        seen = []
        other = threading.Thread(target=lambda: seen.append(fused._pick(fused.eager_swiglu, OnCuda())))
        other.start()
        other.join()
        assert seen == [("compiled", fused.eager_swiglu)]  # another thread (training's) keeps its graphs
    assert fused._pick(fused.eager_rms_norm, OnCuda()) == ("compiled", fused.eager_rms_norm)
