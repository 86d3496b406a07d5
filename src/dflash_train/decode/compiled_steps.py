"""The compiled mode the decode engines share: their decode-sized steps through torch.compile."""

from __future__ import annotations

from collections.abc import Callable

from dflash_train.models.compiled import compile_serialized


class CompiledSteps:
    """The compiled mode of a decode engine (`static_lm.StaticLM`, `static_drafter.StaticDrafter`).

    After `compile()` the engine's decode-sized steps go through torch.compile: inductor fuses
    each layer's norms, RoPE and residual adds (SmolLM2-135M's graphed token step goes from 1,462
    kernels to 605 and 3.23 to 1.56 ms on an H200: docs/evaluation.md). A compiled step attends
    over the whole cache instead of a key-length bucket: one shape, so one compile and one graph
    per step kind, for a few masked keys more per layer. Prefills (and the drafter's pass over the
    prompt before its first step) stay on the eager `forward`: their lengths vary, and each would
    compile anew.
    The engine has `forward` and `_cache` (its last cache, whose graphs were captured eagerly).
    """

    _compiled: Callable | None = None

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def compile(self) -> None:
        """Decode-sized steps (`step`, `step_forward`) through torch.compile from now on."""
        if self._compiled is None:
            self._compiled = compile_serialized(self.forward, dynamic=False)
            self._cache = None  # its graphs were captured from the eager forward

    def step_kv(self, cache, kv_len: int) -> int:
        """The key length a step over `cache` runs with: kv_len, or the whole cache when compiled."""
        return cache.capacity if self.compiled else kv_len

    def step_forward(self, *args, **kwargs):
        """`forward` for decode-sized steps: compiled after `compile()` (pass kv_len through `step_kv`)."""
        return (self._compiled or self.forward)(*args, **kwargs)
