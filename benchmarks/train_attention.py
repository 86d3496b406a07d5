"""The drafter's training attention alone: FlexAttention (--attention flex) against the interval kernels
(--attention intervals), forward and forward + backward, on one pack shaped as `bench`'s.

    python3 benchmarks/train_attention.py --json OUT.json               # the SmolLM2 recipe's shapes, one GPU
    python3 benchmarks/train_attention.py --heads 32 --kv-heads 8 --head-dim 128 --block-size 16 \\
        --num-anchors 512 --seq-len 3072 --token-budget 3072           # Qwen3-8B's bench shapes
    TRITON_INTERPRET=1 python3 benchmarks/train_attention.py --device cpu --heads 4 --kv-heads 2 --head-dim 16 \\
        --block-size 4 --num-anchors 4 --seq-len 40 --token-budget 120 --reps 1 --tiles 16x16   # the CPU plumbing

The pack is the training loader's (random sequences of --seq-len tokens up to --token-budget, --num-anchors
per sequence, the context padded to FlexAttention's tile as objective.py key_context does); q, k and v are
random bf16 in the drafter's layouts. Per layer kind (full, and sliding with --window): ms forward and
forward + backward (CUDA events, median of --reps after warm-up), TFLOP/s on the pairs the mask allows
(4·d FLOPs a pair forward, 10·d with the backward), and each backend's largest error against the other in
the output and the three gradients. --tiles lists the interval kernels' launches to time, each
FORWARD/DQ/DKDV of BLOCK_MxBLOCK_N[xWARPSxSTAGES] (or one for all three). --profile adds each backend's
kernels in one forward + backward (torch.profiler): their sum against the timed forward + backward is the
time the GPU waited on the host. On the CPU (Triton's interpreter) FlexAttention is replaced by the dense
mask's SDPA and the times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this tree's sources first
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling target_profile.py

from target_profile import kernel_table  # noqa: E402

from dflash_train.data.synthetic import SyntheticSequences  # noqa: E402
from dflash_train.devices import resolve_device  # noqa: E402
from dflash_train.models.attention import attend, repeat_kv  # noqa: E402
from dflash_train.models.interval_attention import IntervalMask, Launch, launches  # noqa: E402
from dflash_train.objective.masks import MASK_TILE, MaskSpec, dense_mask, row_intervals, structured_block_mask  # noqa: E402
from dflash_train.pipeline.stream import PackStream  # noqa: E402


def pack_spec(args) -> tuple[MaskSpec, MaskSpec | None]:
    """The (full, sliding) masks of one pack as the objective builds them (context padded to the tile)."""
    data = SyntheticSequences(max(1, args.token_budget // args.seq_len), args.seq_len, 1000, args.seed)
    pack = next(iter(PackStream(data, args.token_budget, args.num_anchors, args.seed, 1).packs(1)))
    pad = -pack.batch.num_tokens % MASK_TILE  # as key_context pads: keys of no sequence (-1)
    seq_ids = torch.cat([pack.batch.seq_ids, torch.full((pad,), -1)])
    positions = torch.cat([pack.batch.positions, torch.zeros(pad, dtype=torch.long)])
    full = MaskSpec(seq_ids, positions, pack.anchors, args.block_size)
    sliding = MaskSpec(seq_ids, positions, pack.anchors, args.block_size, args.window) if args.window else None
    return full, sliding


def timed(fn, reps: int, cuda: bool) -> float:
    """Median ms of `fn` over `reps` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            fn()
            times.append(0.0)
    return statistics.median(times)


def run_backend(name: str, attn, q, k, v, grad, reps: int, cuda: bool, profile: bool = False) -> dict:
    def forward():
        with torch.no_grad():
            return attn(q, k, v)

    def both():
        out = attn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad)

    fwd, fb = timed(forward, reps, cuda), timed(both, reps, cuda)
    out = attn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    result = {"name": name, "forward_ms": round(fwd, 4), "fwd_bwd_ms": round(fb, 4), "tensors": (out, *grads)}
    if profile:  # one forward + backward's kernels: their sum against fwd_bwd_ms is the time the GPU waited
        rows = kernel_table(both, q.device)
        result["kernel_ms"] = round(sum(r["ms"] for r in rows), 4)
        result["kernels"] = [{key: r[key] for key in ("name", "ms", "calls")} for r in rows[:6]]
    return result


def layer_kind(spec: MaskSpec, args, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    rows = row_intervals(spec.seq_ids, spec.positions, spec.anchors, spec.block_size, spec.window)
    Q, M = spec.num_queries, spec.context_len + spec.num_queries
    lo, hi, b_lo, b_hi = rows.long().unbind(0)
    pairs = int(((hi - lo).clamp(min=0) + (b_hi - b_lo).clamp(min=0)).sum()) * args.heads
    gen = torch.Generator(device=device).manual_seed(args.seed)
    dtype = torch.bfloat16 if cuda else torch.float32
    q = torch.randn(1, Q, args.heads, args.head_dim, device=device, dtype=dtype, generator=gen).transpose(1, 2)
    k, v = (torch.randn(1, args.kv_heads, M, args.head_dim, device=device, dtype=dtype, generator=gen)
            for _ in range(2))
    grad = torch.randn(1, args.heads, Q, args.head_dim, device=device, dtype=dtype, generator=gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = args.head_dim ** -0.5
    results = []
    if cuda:
        block = structured_block_mask(spec)
        results.append(run_backend("flex", lambda q, k, v: attend(q, k, v, block, scale), q, k, v, grad, args.reps,
                                   cuda, args.profile))
    else:  # FlexAttention has no CPU backward: the dense predicate instead
        dense = dense_mask(spec)
        results.append(run_backend("dense", lambda q, k, v: F.scaled_dot_product_attention(
            q, *repeat_kv(q, k, v), attn_mask=dense, scale=scale), q, k, v, grad, args.reps, cuda, args.profile))
    for text in args.tiles or ["/".join(map(str, launches(args.head_dim)))]:
        kernels = [Launch.parse(x) for x in text.split("/")]
        kernels = tuple(kernels * 3 if len(kernels) == 1 else kernels)
        mask = IntervalMask.of(rows, M, args.head_dim, kernels)
        results.append(run_backend(f"intervals {'/'.join(map(str, kernels))}",
                                   lambda q, k, v, m=mask: attend(q, k, v, m, scale), q, k, v, grad, args.reps, cuda,
                                   args.profile))
    ref = results[0].pop("tensors")
    for r in results:
        got = r.pop("tensors", ref)
        r["max_err"] = {n: (a.float() - b.float()).abs().max().item() for n, a, b in zip("oqkv", got, ref, strict=True)}
        r["fwd_tflops"] = round(4 * args.head_dim * pairs / r["forward_ms"] / 1e9, 1) if cuda else None
        r["fwd_bwd_tflops"] = round(10 * args.head_dim * pairs / r["fwd_bwd_ms"] / 1e9, 1) if cuda else None
    return {"queries": Q, "keys": M, "allowed_pairs_per_head": pairs // args.heads, "backends": results}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--window", type=int, default=16, help="the sliding layers' window (0: full layers only)")
    p.add_argument("--num-anchors", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=614)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--tiles", nargs="*", help="interval kernel launches to time: FORWARD/DQ/DKDV, each "
                                              "BLOCK_MxBLOCK_N[xWARPSxSTAGES] (one for all three); default theirs")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="also each backend's kernels in one forward + backward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = resolve_device(args.device)
    full, sliding = (s and MaskSpec(*(t.to(device) for t in (s.seq_ids, s.positions, s.anchors)), s.block_size,
                                    s.window) for s in pack_spec(args))
    out = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else "cpu", "torch": torch.__version__, "command": " ".join(["python3", *sys.argv]),
           "args": vars(args), "context_tile": MASK_TILE,
           "full": layer_kind(full, args, device)}
    if sliding is not None:
        out["sliding"] = layer_kind(sliding, args, device)
    for kind in ("full", "sliding"):
        if kind in out:
            print(f"{kind}: {out[kind]['queries']} queries x {out[kind]['keys']} keys, "
                  f"{out[kind]['allowed_pairs_per_head'] / 1e6:.2f}M allowed pairs a head")
            for r in out[kind]["backends"]:
                err = max(r["max_err"].values())
                print(f"  {r['name']:<22} fwd {r['forward_ms']:8.3f} ms ({r['fwd_tflops']} TFLOP/s)  "
                      f"fwd+bwd {r['fwd_bwd_ms']:8.3f} ms ({r['fwd_bwd_tflops']} TFLOP/s)  max err {err:.2e}")
                if "kernels" in r:
                    print(f"    kernels {r['kernel_ms']:.3f} ms: " + ", ".join(
                        f"{x['name'][:40]} {x['ms']:.3f}" for x in r["kernels"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
