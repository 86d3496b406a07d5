"""Compiled entry points: one lock, and inductor's compile workers kept up for the whole run."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config

from dflash_train.models import compiled

_LIMIT = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # torch < 2.7


# torch's config modules are patched with their own `patch`: pytest's monkeypatch deletes a setting it did not
# find in the module's __dict__ (where torch's config keeps none), and torch then reports it missing for good.
quiesce = pytest.mark.skipif(not hasattr(inductor_config, "quiesce_async_compile_pool"),
                             reason="torch < 2.10 has no compile-pool quiesce")


@quiesce
def test_compiled_functions_keep_the_compile_pool_up(monkeypatch):
    # the pool's idle shutdown/wakeup cycle is where an H200 run hung (models/compiled.py)
    monkeypatch.delenv(compiled.QUIESCE_ENV, raising=False)
    with inductor_config.patch(quiesce_async_compile_pool=True):
        fn = compiled.compile_serialized(lambda x: x * 2 + 1)
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0))
        assert inductor_config.quiesce_async_compile_pool is False


@quiesce
def test_the_environment_still_decides_the_compile_pool(monkeypatch):
    monkeypatch.setenv(compiled.QUIESCE_ENV, "1")
    with inductor_config.patch(quiesce_async_compile_pool=True):
        fn = compiled.compile_serialized(lambda x: x + 1)
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))
        assert inductor_config.quiesce_async_compile_pool is True


def _twelve_variants(fn) -> None:
    for n in range(1, 13):  # 12 static shapes: 12 variants
        assert torch.equal(fn(torch.ones(n)), torch.full((n,), 3.0))


@pytest.mark.parametrize("where", ["this thread", "another thread"])
def test_a_function_compiles_past_torchs_eight_variants(where):
    """Training and the evals' decode shapes compile more than 8 variants of one fused chain in one
    process; past torch's default limit dynamo would run it eagerly from then on. From torch 2.13 a
    config setting holds in the thread that made it only, and the target's features are computed on a
    thread of their own: the limit must be raised where the function runs, not only where it was made."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch._dynamo.reset()
    fn = compiled.compile_serialized(lambda x: x * 2 + 1, backend=counter, dynamic=False)  # a variant per shape
    with dynamo_config.patch(_LIMIT, 8):  # torch's default
        if where == "this thread":
            _twelve_variants(fn)
        else:
            worker = ThreadPoolExecutor(1)
            worker.submit(_twelve_variants, fn).result()
            worker.shutdown()
    assert counter.frame_count == 12
    torch._dynamo.reset()


def test_compiled_forward_blocks_restore_the_nested_trace_flag_in_any_exit_order():
    """The target's and the drafter's blocks may close in either order (two threads): the process-wide flag
    stays off while either is open and comes back as it was before the first."""
    import torch._dynamo
    from torch import nn

    from dflash_train.models.compiled import compiled_forwards

    before = torch._dynamo.config.error_on_nested_fx_trace
    a, b = compiled_forwards([nn.Linear(2, 2)], backend="eager"), compiled_forwards([nn.Linear(2, 2)], backend="eager")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert torch._dynamo.config.error_on_nested_fx_trace is False  # b is still open
    b.__exit__(None, None, None)
    assert torch._dynamo.config.error_on_nested_fx_trace is before


def test_dynamic_compiles_leave_out_the_size_guarded_fusion(monkeypatch):
    """Inductor's mix-order reduction guards a dynamic token count on rows x columns >= 5 * 2**20, so on CUDA
    a pack below 9,102 tokens compiled the draft layers again (benchmarks/mix_order_guard.py). Dynamic inductor
    compiles turn that fusion off; static ones, other backends and an explicit mode keep torch's settings."""
    seen, real = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or real(fn, **kw))
    fn = lambda x: x.sum(0) + x.sum(1)  # noqa: E731
    compiled.compile_serialized(fn, dynamic=True)
    compiled.compile_serialized(fn, dynamic={0: 0})
    compiled.compile_serialized(fn, dynamic=False)
    compiled.compile_serialized(fn, dynamic=True, backend="eager")
    compiled.compile_serialized(fn, dynamic=True, mode="max-autotune-no-cudagraphs")
    options = [kw.get("options") for kw in seen]
    assert options == [{"triton.mix_order_reduction": False}] * 2 + [None] * 3
    assert inductor_config.triton.mix_order_reduction is True  # torch's own setting: a compile's option, not a global
