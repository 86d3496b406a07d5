"""Compiled entry points: one lock, and inductor's compile workers kept up for the whole run."""

import torch
import torch._inductor.config as inductor_config

from dflash_train.models import compiled


def test_compiled_functions_keep_the_compile_pool_up(monkeypatch):
    # the pool's idle shutdown/wakeup cycle is where an H200 run hung (models/compiled.py)
    monkeypatch.delenv(compiled.QUIESCE_ENV, raising=False)
    monkeypatch.setattr(inductor_config, "quiesce_async_compile_pool", True)
    fn = compiled.compile_serialized(lambda x: x * 2 + 1)
    assert inductor_config.quiesce_async_compile_pool is False
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0))


def test_the_environment_still_decides_the_compile_pool(monkeypatch):
    monkeypatch.setenv(compiled.QUIESCE_ENV, "1")
    monkeypatch.setattr(inductor_config, "quiesce_async_compile_pool", True)
    compiled.compile_serialized(lambda x: x + 1)
    assert inductor_config.quiesce_async_compile_pool is True


def test_a_function_compiles_past_torchs_eight_variants(monkeypatch):
    """Training and the evals' decode shapes compile more than 8 variants of one fused chain in one
    process; past torch's default limit dynamo would run it eagerly from then on."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.testing import CompileCounter

    monkeypatch.setattr(dynamo_config, "recompile_limit", 8)  # torch's default
    counter = CompileCounter()
    torch._dynamo.reset()
    fn = compiled.compile_serialized(lambda x: x * 2 + 1, backend=counter, dynamic=False)  # a variant per shape
    for n in range(1, 13):  # 12 static shapes: 12 variants
        assert torch.equal(fn(torch.ones(n)), torch.full((n,), 3.0))
    assert counter.frame_count == 12 and dynamo_config.recompile_limit == compiled.RECOMPILE_LIMIT
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
