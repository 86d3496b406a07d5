"""Inductor's mix-order reduction and the size guard it puts on dynamic token counts (CUDA only).

    python3 benchmarks/mix_order_guard.py

An RMSNorm (float32, as the drafter computes it) and an RMSNorm + SiLU MLP + residual at the drafter's
width 576, compiled with every size dynamic, forward and backward over token counts 16,384, 6,000,
15,000, 4,000 and 12,000: the number of graphs after each count, the seconds of those first calls, and
forward + backward at 16K tokens (50 back-to-back calls after 5 warm-up ones). Three Inductor settings:
the default (the fusion on, guarded on rows x columns >= 5 * 2**20), `mix_order_reduction_non_strict_mode`
(fused at any size) and the fusion off (what models/compiled.size_free_options picks).
"""

from __future__ import annotations

import time

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from dflash_train.models.fused import _rms_norm as rms  # the drafter's own norm math

VARIANTS = [("default", {}), ("non_strict", {"triton.mix_order_reduction_non_strict_mode": True}),
            ("mix_off", {"triton.mix_order_reduction": False})]
SIZES = (16384, 6000, 15000, 4000, 12000)


def layer(x, w, a, b):
    h = rms(x, w, 1e-6).to(x.dtype)
    return x + torch.nn.functional.silu(h @ a) @ b


def measure(fn, opts: dict, dev: str = "cuda") -> tuple[list[int], float, float]:
    """(graphs after each size, seconds of the first calls, ms of forward + backward at 16K tokens)."""
    torch._dynamo.reset()
    counters.clear()
    c = torch.compile(fn, dynamic=True, options=opts)
    w = torch.ones(576, device=dev, requires_grad=True)
    a = (torch.randn(576, 1536, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    b = (torch.randn(1536, 576, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    t0, graphs = time.perf_counter(), []
    for n in SIZES:
        x = torch.randn(n, 576, device=dev, dtype=torch.bfloat16, requires_grad=True)
        c(x, w, a, b).float().square().mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    x = torch.randn(16384, 576, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(5):
        c(x, w, a, b).float().square().mean().backward()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        c(x, w, a, b).float().square().mean().backward()
    torch.cuda.synchronize()
    return graphs, first_s, (time.perf_counter() - t0) / 50 * 1e3


def main() -> None:
    torch._dynamo.config.recompile_limit = 64
    for name, opts in VARIANTS:
        for fname, fn in [("rms", lambda x, w, a, b: rms(x, w, 1e-6)), ("layer", layer)]:
            graphs, first_s, ms = measure(fn, opts)
            print(f"{name:10s} {fname:5s} graphs after each size {graphs}  first calls {first_s:.1f}s  "
                  f"fwd+bwd 16K {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
