"""A mixture-of-experts layer's top-k combine alone: transformers' expression against dflash_grouped's kernel.

    python3 benchmarks/moe_combine.py                   # one GPU, ~1 minute; Qwen3-30B-A3B's routing shapes
    python3 benchmarks/moe_combine.py --blocks 256,512,1024,2048
    TRITON_INTERPRET=1 python3 benchmarks/moe_combine.py --device cpu --tokens 16 --width 64 --experts 8

The combine takes the experts' output rows, in the order the sort by expert left them, and gives each
token the sum of its k rows times their routing weights (models/grouped_experts.py). Variants, each on
the same random routing (T tokens, k of E experts, H columns):
- `hf eager` and `hf compiled`: transformers' expression (weight the sorted rows, invert the sort's
  permutation, gather, view [T, k, H], sum over k), eagerly and under torch.compile;
- `index_add fp32`: scatter-add of the weighted rows into a float32 [T, H] (atomics; order-dependent);
- `triton B`: dflash_grouped's kernel with B columns a program (the library's default is marked).
Each prints microseconds a call (CUDA events, mean of 50 after 5 warm-ups), the rate of its compulsory
bytes (the T*k rows read once, the [T, H] result written once) and its largest difference from
`hf eager` (the kernel rounds each weighted row as it does; index_add keeps float32 until the end).
On a CPU (the plumbing; triton's interpreter runs the kernel) the times mean nothing and `hf compiled`
is left out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

# Run from a checkout without installing: the working tree's sources come first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflash_train.models import grouped_experts  # noqa: E402


def hf_combine(rows: torch.Tensor, weights_sorted: torch.Tensor, perm: torch.Tensor, t: int, k: int) -> torch.Tensor:
    weighted = rows * weights_sorted.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return weighted[inverse].view(t, k, -1).sum(dim=1).to(rows.dtype)


def index_add_combine(rows: torch.Tensor, weights_sorted: torch.Tensor, perm: torch.Tensor, t: int,
                      k: int) -> torch.Tensor:
    out = torch.zeros(t, rows.shape[1], device=rows.device, dtype=torch.float32)
    out.index_add_(0, perm // k, rows.float() * weights_sorted.unsqueeze(-1))
    return out.to(rows.dtype)


def kernel_combine(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, block: int) -> torch.Tensor:
    t, k = weights.shape
    width = rows.shape[1]
    out = rows.new_empty(t, width, dtype=torch.promote_types(rows.dtype, weights.dtype))
    grid = (t, grouped_experts.triton.cdiv(width, block))
    grouped_experts._combine_kernel[grid](rows, slots, weights, out, width, K=k, ROUND=out.dtype != torch.float32,
                                          BLOCK=block, num_warps=4)
    return out


def mean_us(fn, device: torch.device, n: int = 50) -> float:
    for _ in range(5):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()  # host sync: the timed window's start
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def routing(t: int, k: int, width: int, experts: int, seed: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, device=device, generator=gen)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, device=device, generator=gen), -1).to(torch.bfloat16)
    _, perm = torch.sort(ids.reshape(-1), stable=True)
    rows = torch.randn(t * k, width, device=device, generator=gen).to(torch.bfloat16)
    slots = torch.empty_like(perm)
    slots[perm] = torch.arange(perm.numel(), device=device)
    return rows, weights, perm, slots


def time_combines(t: int, args: argparse.Namespace, device: torch.device) -> None:
    """Every variant at t tokens, one line each."""
    k = args.top_k
    rows, weights, perm, slots = routing(t, k, args.width, args.experts, args.seed, device)
    weights_sorted = weights.reshape(-1)[perm]
    variants = {"hf eager": lambda: hf_combine(rows, weights_sorted, perm, t, k)}
    if device.type == "cuda":
        compiled = torch.compile(hf_combine, dynamic=False)
        variants["hf compiled"] = lambda: compiled(rows, weights_sorted, perm, t, k)
    variants["index_add fp32"] = lambda: index_add_combine(rows, weights_sorted, perm, t, k)
    for block in (int(b) for b in args.blocks.split(",")):
        mark = "*" if block == grouped_experts._COMBINE_BLOCK else ""
        variants[f"triton {block}{mark}"] = lambda b=block: kernel_combine(rows, slots, weights, b)
    want = variants["hf eager"]().float()
    nbytes = (rows.numel() + t * args.width) * rows.element_size()
    for name, fn in variants.items():
        diff = (fn().float() - want).abs().max().item()
        us = mean_us(fn, device, n=50 if device.type == "cuda" else 2)
        print(f"T={t} {name:16s} {us:8.1f} us  {nbytes / us / 1e6:6.2f} TB/s  max|diff| {diff:.3g}", flush=True)


def kernel_args(p: argparse.ArgumentParser, has_triton: bool) -> tuple[argparse.Namespace, torch.device | None]:
    """A kernel benchmark's flags with --seed and --device added, and the device it runs on (`auto`: CUDA where
    there is one), or None, having said why, where its Triton kernel cannot run: no triton, or a CPU without
    TRITON_INTERPRET=1."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if not has_triton or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"):
        print(f"{p.prog}: the kernel needs triton, and on a CPU TRITON_INTERPRET=1", file=sys.stderr)
        return args, None
    return args, device


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="3072,12288", help="comma-separated token counts")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--blocks", default=str(grouped_experts._COMBINE_BLOCK), help="comma-separated column blocks")
    args, device = kernel_args(p, grouped_experts.triton is not None)
    if device is None:
        return 2
    for t in (int(x) for x in args.tokens.split(",")):
        time_combines(t, args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
