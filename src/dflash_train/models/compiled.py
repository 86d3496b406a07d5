"""torch.compile'd functions called from two threads of one process (target thread + drafter).

Dynamo is not thread-safe while it compiles: FX's "tracing" flag is process-global, so a
compiled function entered by one thread while another compiles raises ("using FX to
symbolically trace a dynamo-optimized function"; seen on the H200 with --compile-target).
Every compiled entry point of this package goes through one lock: a call that compiles holds
it, so no other compiled call starts meanwhile. Calls that do not compile only launch kernels
and hold the lock for microseconds.

Inductor compiles in a pool of worker processes, which by default shuts down after 60 s without
a compile and wakes up at the next one. A training run recompiles now and then (a pack whose
length crosses a size guard, the eval's no-grad forwards), minutes apart, so it crosses that
shutdown/wakeup cycle again and again; upstream reports races in it (pytorch#176968, #186136:
executor threads left behind across quiesce cycles), and an 8-layer H200 run stopped for good
at the first recompile that came 60+ s after the previous one (docs/pipeline.md, "Measured").
`compile_serialized` keeps the pool up for the process's life instead, unless the environment
says otherwise (TORCHINDUCTOR_QUIESCE_ASYNC_COMPILE_POOL).

From torch 2.13 a dynamo/inductor config setting holds only in the thread (context) that made it; up to
2.12 it held for the process. So the settings a compile needs are made in the thread that calls the
compiled function (the target's features are computed on a thread of their own), not only where it was made.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

import torch
from torch import nn

from dflash_train.errors import say

F = TypeVar("F", bound=Callable)

_LOCK = threading.RLock()
QUIESCE_ENV = "TORCHINDUCTOR_QUIESCE_ASYNC_COMPILE_POOL"
RECOMPILE_LIMIT = 64  # compiled variants per function a process may hold (torch's default: 8)


def keep_compile_pool() -> None:
    """No idle shutdown of inductor's compile workers (read when the pool starts: call before the
    first compile); an explicit TORCHINDUCTOR_QUIESCE_ASYNC_COMPILE_POOL wins."""
    if QUIESCE_ENV in os.environ:
        return
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "quiesce_async_compile_pool"):  # torch >= 2.10
        inductor_config.quiesce_async_compile_pool = False


def allow_recompiles() -> None:
    """Room for every variant a train job compiles of one function. Past recompile_limit variants
    dynamo runs the function eagerly, with a warning. The fused drafter chains (models/fused.py)
    are compiled for training (with grad, dynamic token counts, size-1 specializations) and again,
    in the same process, for the evals' no-grad decode shapes; on the H200 (2026-12-02) the eval
    after training hit the limit for the `rms_norm` and `norm_rope` chains and decoded at 5.50 ms per DFlash
    step, against 4.77-4.79 ms for the same drafter in fresh processes. Raised, not lowered: an
    explicit higher setting stays."""
    import torch._dynamo.config as dynamo_config

    setattr(dynamo_config, _limit_name(), max(getattr(dynamo_config, _limit_name()), RECOMPILE_LIMIT))


@functools.cache
def _limit_name() -> str:
    import torch._dynamo.config as dynamo_config

    return "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # torch < 2.7


def _compile_settings_here() -> None:
    """`keep_compile_pool` and `allow_recompiles` in the calling thread, unless they hold there already:
    one config read per call (about a microsecond) where a compiled call launches kernels for milliseconds."""
    import torch._dynamo.config as dynamo_config

    if getattr(dynamo_config, _limit_name()) < RECOMPILE_LIMIT:
        keep_compile_pool()
        allow_recompiles()


def size_free_options(dynamic: Mapping[int, int] | bool | None, compile_kwargs: Mapping) -> dict:
    """Inductor options that keep a dynamic graph free of size guards: {} for static compiles, other
    backends, an explicit mode or options, or a torch without the setting.

    Inductor's mix-order reduction (a backward's row and column sums of one tensor in one kernel)
    fuses only when rows x columns >= 5 * 2**20 and guards on that, so a dynamic token count gets
    specialized there: 9,102 tokens at the drafter's width 576, and a smaller pack (the epoch's
    leftover) compiled the draft layers and norms again (the H200 recipe's epoch boundary, 17-38 s
    on a fresh machine; docs/performance.md). With the fusion off, token counts 4K-16K
    compiled one graph on the H200 (2026-12-03) where the default compiled two; forward + backward
    at 16K tokens x 576: RMSNorm 1.15 -> 0.88 ms, RMSNorm + MLP 1.71 -> 1.79 ms
    (benchmarks/results/mix-order-guard-h200-2026-12-03.json)."""
    if dynamic is False or compile_kwargs.get("backend", "inductor") != "inductor":
        return {}
    if "mode" in compile_kwargs or "options" in compile_kwargs:  # torch.compile takes one of the two
        return {}
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config.triton, "mix_order_reduction"):  # an older torch: no such fusion
        return {}
    return {"triton.mix_order_reduction": False}


def compile_serialized(fn: F, dynamic: Mapping[int, int] | bool | None = None, **compile_kwargs) -> F:
    """torch.compile(fn), each call made under the process's compile lock.

    dynamic: {positional argument: dimension} compiled as dynamic from the first call. Token
    counts change (the context's vs the block's, pack to pack, the last loss chunk), and under
    automatic dynamic shapes each such function compiled twice: static first, then dynamic.
    True or False: torch.compile's own `dynamic` (False: one static variant per shape).
    Dynamic compiles get `size_free_options`.
    """
    keep_compile_pool()
    allow_recompiles()
    options = size_free_options(dynamic, compile_kwargs)
    if options:
        compile_kwargs["options"] = options
    if isinstance(dynamic, bool):
        compile_kwargs["dynamic"], dynamic = dynamic, None
    compiled = torch.compile(fn, **compile_kwargs)
    marks = tuple((dynamic or {}).items())

    @functools.wraps(fn)
    def call(*args, **kwargs):
        for i, dim in marks:
            torch._dynamo.maybe_mark_dynamic(args[i], dim % args[i].dim())
        with _LOCK:
            _compile_settings_here()
            return compiled(*args, **kwargs)
    return call  # type: ignore[return-value]


def eager_on_failure(compiled: F, eager: F, what: str) -> F:
    """compiled(*args); where torch.compile fails on it, one line naming `what` and `eager` from then on (the same
    results, for a compiled function that only buys speed). Errors that are not the compiler's still raise."""
    run = [compiled]

    @functools.wraps(eager)
    def call(*args, **kwargs):
        try:
            return run[0](*args, **kwargs)
        except Exception as e:
            if run[0] is eager or not isinstance(e, _compiler_errors()):
                raise
            cause = getattr(e, "inner_exception", None) or e  # BackendCompilerFailed's first line names the backend
            first = (str(cause).strip().splitlines() or [""])[0][:160]
            say(f"{what} failed to compile ({type(cause).__name__}: {first}); they are made eagerly")
            run[0] = eager
            return eager(*args, **kwargs)
    return call  # type: ignore[return-value]


@functools.cache
def _compiler_errors() -> tuple[type[Exception], ...]:
    """What torch.compile raises when it cannot compile (imported when first needed: Dynamo is slow to import)."""
    import torch._dynamo.exc
    import torch._inductor.exc

    inductor = getattr(torch._inductor.exc, "InductorError", None)  # raised unwrapped by some versions
    return (torch._dynamo.exc.TorchDynamoException, *([inductor] if inductor else []))


@contextlib.contextmanager
def compiled_forwards(modules: Iterable[nn.Module], backend: str = "inductor",
                      dynamic: Mapping[int, int] | bool | None = None) -> Iterator[None]:
    """Inside: each module's `forward` under torch.compile; the class's eager forward again on exit.

    Only `forward` is compiled, so the modules' hooks (feature capture, profiling spans) stay
    outside the graph. Modules of one class share one graph: their parameters are graph inputs.
    The compile lock keeps compiles apart from other compiled calls, but a backward graph
    compiled lazily on autograd's thread is outside it; a compiled function entered meanwhile by
    another thread then runs eagerly for that call instead of raising.
    """
    modules = list(modules)
    for module in modules:
        module.forward = compile_serialized(module.forward, dynamic=dynamic, backend=backend)
    _lazy_backward_compiles(+1)
    try:
        yield
    finally:
        _lazy_backward_compiles(-1)
        for module in modules:
            del module.forward


_OPEN = {"count": 0, "saved": True}  # compiled_forwards blocks open in this process, and the flag before the first


def _lazy_backward_compiles(delta: int) -> None:
    """dynamo's error_on_nested_fx_trace is process-wide: off while any compiled_forwards block is open (the
    target's and the drafter's may close in either order, on different threads), as it was before the first."""
    import torch._dynamo

    with _LOCK:
        if delta > 0 and _OPEN["count"] == 0:
            _OPEN["saved"] = torch._dynamo.config.error_on_nested_fx_trace
        _OPEN["count"] += delta
        torch._dynamo.config.error_on_nested_fx_trace = _OPEN["saved"] if _OPEN["count"] == 0 else False
