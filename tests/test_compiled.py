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
