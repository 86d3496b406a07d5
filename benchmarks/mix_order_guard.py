"""Inductor's mix-order reduction and the size guard it puts on dynamic token counts (CUDA only).

    python3 benchmarks/mix_order_guard.py [--json OUT.json]
    python3 benchmarks/mix_order_guard.py --device cpu --backend aot_eager --sizes 64 32 --reps 1  # check the script

An RMSNorm (float32, as the drafter computes it) and an RMSNorm + SiLU MLP + residual at the drafter's
width 576, compiled with every size dynamic, forward and backward over token counts 16,384, 6,000,
15,000, 4,000 and 12,000: the number of graphs after each count, the seconds of those first calls, and
forward + backward at 16K tokens (50 back-to-back calls after 5 warm-up ones). Three Inductor settings:
the default (the fusion on, guarded on rows x columns >= 5 * 2**20), `mix_order_reduction_non_strict_mode`
(fused at any size) and the fusion off (what models/compiled.size_free_options picks).
The fusion is Inductor's Triton code generation on CUDA: on a CPU, and with any backend other than
inductor, the three settings compile alike and the figures say nothing about it (the check only runs
the script's path: compile, count graphs, time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from dflash_train.models.fused import eager_rms_norm as rms  # the drafter's own norm math

VARIANTS = [("default", {}), ("non_strict", {"triton.mix_order_reduction_non_strict_mode": True}),
            ("mix_off", {"triton.mix_order_reduction": False})]
SIZES = (16384, 6000, 15000, 4000, 12000)


def layer(x, w, a, b):
    h = rms(x, w, 1e-6).to(x.dtype)
    return x + torch.nn.functional.silu(h @ a) @ b


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()  # host sync: the clock reads finished work


def measure(fn, opts: dict, dev: str = "cuda", sizes: tuple[int, ...] = SIZES, reps: int = 50,
            backend: str = "inductor") -> tuple[list[int], float, float]:
    """(graphs after each size, seconds of the first calls, ms of forward + backward at the first size)."""
    torch._dynamo.reset()
    counters.clear()
    # options are Inductor's: another backend takes none
    c = torch.compile(fn, dynamic=True, backend=backend, **({"options": opts} if backend == "inductor" else {}))
    w = torch.ones(576, device=dev, requires_grad=True)
    a = (torch.randn(576, 1536, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    b = (torch.randn(1536, 576, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    t0, graphs = time.perf_counter(), []
    for n in sizes:
        x = torch.randn(n, 576, device=dev, dtype=torch.bfloat16, requires_grad=True)
        c(x, w, a, b).float().square().mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    _sync(dev)
    first_s = time.perf_counter() - t0
    x = torch.randn(sizes[0], 576, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(min(5, reps)):
        c(x, w, a, b).float().square().mean().backward()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        c(x, w, a, b).float().square().mean().backward()
    _sync(dev)
    return graphs, first_s, (time.perf_counter() - t0) / reps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script (see above)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: the CPU check)")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                    help="token counts, in order; the first is timed")
    ap.add_argument("--reps", type=int, default=50, help="timed forward + backward calls at the first size")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    torch._dynamo.config.recompile_limit = 64
    out: dict = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
                 "date": date.today().isoformat(), "torch": torch.__version__, "backend": args.backend,
                 "command": "python3 benchmarks/mix_order_guard.py " + " ".join(sys.argv[1:] if argv is None else argv),
                 "sizes": args.sizes, "graphs_after_each_size": {}, "first_calls_s": {}, "fwd_bwd_ms": {}}
    for name, opts in VARIANTS:
        for fname, fn in [("rms", lambda x, w, a, b: rms(x, w, 1e-6)), ("layer", layer)]:
            graphs, first_s, ms = measure(fn, opts, args.device, tuple(args.sizes), args.reps, args.backend)
            print(f"{name:10s} {fname:5s} graphs after each size {graphs}  first calls {first_s:.1f}s  "
                  f"fwd+bwd {args.sizes[0]} tokens {ms:.3f} ms", flush=True)
            out["graphs_after_each_size"].setdefault(name, {})[fname] = graphs
            out["first_calls_s"].setdefault(name, {})[fname] = round(first_s, 2)
            out["fwd_bwd_ms"].setdefault(name, {})[fname] = round(ms, 3)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
