"""torch.compile'd functions called from two threads of one process (target thread + drafter).

Dynamo is not thread-safe while it compiles: FX's "tracing" flag is process-global, so a
compiled function entered by one thread while another compiles raises ("using FX to
symbolically trace a dynamo-optimized function"; seen on the H200 with --compile-target).
Every compiled entry point of this package goes through one lock: a call that compiles holds
it, so no other compiled call starts meanwhile. Calls that do not compile only launch kernels
and hold the lock for microseconds.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

_LOCK = threading.RLock()


def compile_serialized(fn: F, dynamic: Mapping[int, int] | None = None, **compile_kwargs) -> F:
    """torch.compile(fn), each call made under the process's compile lock.

    dynamic: {positional argument: dimension} compiled as dynamic from the first call. Token
    counts change (the context's vs the block's, pack to pack, the last loss chunk), and under
    automatic dynamic shapes each such function compiled twice: static first, then dynamic.
    """
    compiled = torch.compile(fn, **compile_kwargs)
    marks = tuple((dynamic or {}).items())

    @functools.wraps(fn)
    def call(*args, **kwargs):
        for i, dim in marks:
            torch._dynamo.maybe_mark_dynamic(args[i], dim % args[i].dim())
        with _LOCK:
            return compiled(*args, **kwargs)
    return call  # type: ignore[return-value]
