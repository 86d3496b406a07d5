"""A batch-1 step's attention, one layer: the batched-matmul path against the span kernel and its tile shapes.

    python3 benchmarks/span_attention.py --json benchmarks/results/span-attention-h100.json

For each step shape (a one-token target step, an 8-token verify, a drafter block over its context) and key
count, one layer's attention as a decode forward runs it: the batched-matmul path (`static_lm.cached_attention`
with the mask made once, then the transposed copy o_proj needs) and `span_attention` with each tile shape.
Each is called `--layers` times inside one CUDA graph, replayed `--reps` times (decode_parts' timing), so a
figure is the GPU time of one call among many, launch gaps included: at batch 1 that is most of it.
`--device cpu` checks the script (the kernel under TRITON_INTERPRET=1, float32, wall clock): not a measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import date

import torch

sys.path.insert(0, os.path.dirname(__file__))
import decode_parts  # noqa: E402  (benchmarks/ is not a package)

from dflash_train.decode import span_attention as sa  # noqa: E402
from dflash_train.decode.static_lm import Mask, cached_attention  # noqa: E402

TILES = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3)]  # block, warps, stages


def _shapes(context: int) -> dict[str, tuple[int, int, int]]:
    """name -> (query tokens, first query's position, causal): SmolLM2-135M's target and a drafter of its width."""
    return {"token": (1, context, True), "verify8": (8, context, True), "draft8": (8, context, False)}


def _layer_times(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hi: torch.Tensor, layers: int, reps: int,
                 tiles: list[tuple[int, int, int]]) -> dict[str, float]:
    """Microseconds a call: the batched-matmul path and the span kernel in each tile shape, queries q [1, H, n, d]
    seeing slots below hi [1, n]."""
    b, H, n, d = q.shape
    kv_len = int(hi.max())
    lo = torch.zeros_like(hi)
    slots = torch.arange(kv_len, device=q.device)
    mask = Mask.of(slots[None, None] < hi[..., None], H // k.shape[1])

    def batched(_):
        for _ in range(layers):
            cached_attention(q, k[:, :, :kv_len], v[:, :, :kv_len], mask, 0.125).transpose(1, 2).reshape(b, n, H * d)

    def kernel(tile):
        def run(_):
            for _ in range(layers):
                sa.span_attention(q, k, v, lo, hi, 0.125, block=tile[0], warps=tile[1], stages=tile[2])
        return run

    out = {"batched": round(1e3 * decode_parts._time(batched, reps) / layers, 2)}
    for tile in tiles:
        out["span_b{}_w{}_s{}".format(*tile)] = round(1e3 * decode_parts._time(kernel(tile), reps) / layers, 2)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--contexts", default="512,1024")
    ap.add_argument("--layers", type=int, default=30, help="calls per graph (a forward's layers)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    dev = decode_parts.DEVICE = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    H, hkv, d = args.heads, args.kv_heads, args.head_dim
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "date": date.today().isoformat(),
           "torch": torch.__version__, "heads": H, "kv_heads": hkv, "head_dim": d, "layers": args.layers,
           "command": "python3 benchmarks/span_attention.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "us_per_call": {}}
    for context in map(int, args.contexts.split(",")):
        k, v = (torch.randn(1, hkv, context + 128, d, device=dev, dtype=dtype) for _ in range(2))
        for name, (n, first, causal) in _shapes(context).items():
            q = torch.randn(1, n, H, d, device=dev, dtype=dtype).transpose(1, 2)  # the projections' layout
            pos = first + torch.arange(n, device=dev)[None]
            hi = (pos + 1 if causal else torch.full_like(pos, first + n)).to(torch.int32)
            row = _layer_times(q, k, v, hi, args.layers, args.reps, TILES if dev.type == "cuda" else TILES[:1])
            res["us_per_call"][f"{name}@{context}"] = row
            print(f"{name}@{context}", row, flush=True)
    if args.json:
        decode_parts._write(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
