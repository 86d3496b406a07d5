"""The drafter layer's elementwise chains, one kernel each on CUDA (torch.compile), eager elsewhere.

Eager PyTorch runs each chain as a string of full passes over the activations: an RMSNorm in
float32 is ~8 kernels (cast, square, mean, add, rsqrt, multiply, cast, scale), RoPE ~6, SwiGLU
3, and autograd doubles that in backward. At Qwen3-8B drafter shapes (8,192 block tokens x
4,096, 12,288 MLP columns) these passes are ~40 GB of HBM traffic per training step; fused they
read and write each tensor once. The `eager_*` functions are the math (run on CPU, and the
reference the tests compare against); `rms_norm`, `norm_rope` and `swiglu` run them, on CUDA
compiled once per process behind the compile lock (`models/compiled.py`) with the token dimension
dynamic from the start, so a new token count compiles nothing. torch.compile guards on the grad mode
and autocast, so code that runs the drafter in others (the eval: decoding and its replay through the
training path) runs the chains eagerly inside `eager_chains()` instead of compiling them again.

The drafter's forward is training's and decoding's alike, so these live with the drafter in models/.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from dflash_train.models.compiled import compile_serialized


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, as Qwen3 computes it, then cast back and scaled."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm then RoPE. x [b, n, heads, d]; cos, sin [b, n, d]."""
    x = eager_rms_norm(x, weight, eps)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


def eager_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_COMPILED: dict[str, Callable] = {}
_EAGER = threading.local()  # eager_chains() sets .on for its thread
# the token dimension of each tensor argument, dynamic from the first compile
_TOKEN_DIMS = {"eager_rms_norm": {0: -2}, "eager_norm_rope": {0: 1, 3: 1, 4: 1}, "eager_swiglu": {0: -2, 1: -2}}


@contextlib.contextmanager
def eager_chains() -> Iterator[None]:
    """Inside (this thread only): the chains run eagerly on CUDA too. For forwards in another grad mode or
    autocast than training's (the whole eval: its decode engines and its replay), for which torch.compile
    would compile every chain again, seconds each on a fresh machine, to save microseconds."""
    before = getattr(_EAGER, "on", False)
    _EAGER.on = True
    try:
        yield
    finally:
        _EAGER.on = before


def _pick(fn: Callable, x: torch.Tensor) -> Callable:
    # eager off CUDA, inside a caller's torch.compile (its trace fuses the plain function) and in eager_chains()
    if not x.is_cuda or torch.compiler.is_compiling() or getattr(_EAGER, "on", False):
        return fn
    if fn.__name__ not in _COMPILED:  # compiled on first CUDA use, not at import
        _COMPILED[fn.__name__] = compile_serialized(fn, dynamic=_TOKEN_DIMS[fn.__name__])
    return _COMPILED[fn.__name__]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _pick(eager_rms_norm, x)(x, weight, eps)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _pick(eager_norm_rope, x)(x, weight, eps, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _pick(eager_swiglu, gate)(gate, up)
