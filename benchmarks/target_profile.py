"""Where a target's feature forward spends its device time: its kernels by kind, under each experts kernel.

    python3 benchmarks/target_profile.py --target random:qwen3-30b-a3b --experts grouped_mm,eager \\
        --seq-len 3072 --json benchmarks/results/OUT.json            # one H200, ~3 minutes
    python3 benchmarks/target_profile.py --target random:qwen3-30b-a3b --experts grouped_mm --compile-target
    python3 benchmarks/target_profile.py --target random:tiny-qwen3-moe --device cpu --seq-len 64 --steps 2

The forward is training's (pipeline/features.py packed_features: --sequences packed sequences of --seq-len
random tokens, the layers up to the drafter's deepest feature layer, five features), as `bench --variants
target-only` runs it (its `--token-budget` 12,288 at 3,072-token sequences is `--sequences 4`). Per experts
kernel (models/experts.py; a dense target runs once): --warmup forwards (compilation, allocator), then
--steps timed forwards (one host sync at each end) for tokens/s and MFU on active FLOPs
(profiling/flops.py, H200 dense BF16 peak); then --steps forwards each from an idle device, timing how
long the call takes to return (`host_ms`: the host's work, launches included, plus any wait inside
for the device) against its wall time; a forward whose host_ms is close to its wall time is
host-bound, and a faster kernel does not shorten it. Every kernel is timed before any is profiled (a
profiler session may leave later launches slower in the process). Then one forward of each under
torch.profiler. Its kernels are summed by name and sorted into kinds by name (KINDS, first match):
GEMMs, grouped GEMMs, attention, routing and indexing (sort, gather, scatter, histogram), Inductor's
fused chains, normalisation, elementwise and the rest; printed with their share of the device time and
the top --top kernels. The profile says what a faster forward must change: at 0.18 MFU (Qwen3-30B-A3B,
grouped_mm, 2026-12-05) the question is whether the grouped GEMMs themselves are slow or the routing
and copies around them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import torch

# Run from a checkout without installing: the working tree's sources come first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflash_train.data.packing import PackedBatch  # noqa: E402
from dflash_train.devices import resolve_device  # noqa: E402
from dflash_train.models.config import default_target_layer_ids  # noqa: E402
from dflash_train.models.experts import CHOICES, is_moe, use_experts  # noqa: E402
from dflash_train.models.loading import load_target  # noqa: E402
from dflash_train.pipeline.features import packed_features  # noqa: E402
from dflash_train.profiling.flops import PEAK_BF16, shape_of, target_flops  # noqa: E402

# A kernel's kind from its name (first match, case-insensitive): what the time is spent on.
KINDS = (
    # Inductor names a fused kernel after every operator it holds ("..._grouped_mm_..._sum_..."): by its prefix
    # first, so a chain around a grouped GEMM or an attention does not count as one
    ("Inductor fused chains", r"^triton_(poi|per|red)_"),
    # torch's grouped_mm on sm90 is CUTLASS's pointer-array GEMM over a GroupProblemShape
    ("grouped GEMM", r"GroupProblemShape|PtrArray|grouped|group_gemm"),
    ("GEMM", r"gemm|cutlass|nvjet|sm90_xmma|matmul|\bmm\b|addmm|bmm|linear"),
    ("attention", r"flash|fmha|attention|flex|sdpa|softmax|triton_tem"),  # Inductor's templates: FlexAttention
    ("routing / indexing", r"sort|radix|histc|histogram|cumsum|scan|index|gather|scatter|topk|nonzero|where|combine"),
    ("normalisation", r"norm|rsqrt"),
    ("elementwise / copies", r"elementwise|vectorized|copy|cat|fill|silu|mul|add|cast"),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def sequences(count: int, seq_len: int, vocab: int, device: torch.device, seed: int) -> PackedBatch:
    """`count` packed sequences of seq_len random tokens each."""
    gen = torch.Generator().manual_seed(seed)
    n = count * seq_len
    ids = torch.randint(0, vocab, (n,), generator=gen)
    seq_ids = torch.arange(count).repeat_interleave(seq_len)
    return PackedBatch(ids, torch.ones(n, dtype=torch.long), seq_ids, torch.arange(seq_len).repeat(count)).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: the timed window's ends


def timed(forward, device: torch.device, warmup: int, steps: int) -> float:
    """Seconds per forward over `steps` forwards after `warmup`."""
    for _ in range(warmup):
        forward()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        forward()
    sync(device)
    return (time.perf_counter() - t0) / steps


def host_and_wall(forward, device: torch.device, steps: int) -> tuple[float, float]:
    """(seconds until a forward returns, seconds until the device finishes it), each the fastest of
    `steps` forwards started from an idle device."""
    host, wall = [], []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        sync(device)
        host.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
    return min(host), min(wall)


def kernel_table(forward, device: torch.device) -> list[dict]:
    """Every kernel of one forward (CUDA; on a CPU its operators), summed by name, longest first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        forward()
        sync(device)
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if cuda and not on_device:
            continue
        if not cuda and not event.name.startswith("aten::"):
            continue
        us = event.time_range.elapsed_us() if cuda else event.self_cpu_time_total  # a kernel's own span
        total[event.name][0] += us
        total[event.name][1] += 1
    rows = [{"name": n, "kind": kind_of(n), "ms": us / 1e3, "calls": c} for n, (us, c) in total.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def by_kind(rows: list[dict]) -> dict[str, dict]:
    all_ms = sum(r["ms"] for r in rows) or 1.0
    kinds: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "kernels": 0})
    for r in rows:
        kinds[r["kind"]]["ms"] += r["ms"]
        kinds[r["kind"]]["kernels"] += r["calls"]
    return {k: {**v, "share": v["ms"] / all_ms} for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["ms"])}


def feature_forward(args, target, experts: str, layer_ids: list[int]):
    """(the implementation set, the packed batch, a no-grad feature forward under that experts kernel)."""
    impl = use_experts(target.model, experts)
    batch = sequences(args.sequences, args.seq_len, target.vocab_size, target.device, args.seed)

    def forward():
        with torch.no_grad():
            packed_features(target, batch, layer_ids)
    return impl, batch, forward


def time_target(args, target, experts: str, layer_ids: list[int], flops: float) -> dict:
    device = target.device
    impl, batch, forward = feature_forward(args, target, experts, layer_ids)
    with target.compiled_layers(args.compile_target):
        seconds = timed(forward, device, args.warmup, args.steps)
        host_s, wall_s = host_and_wall(forward, device, args.steps)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"experts": impl, "ms": 1e3 * seconds, "tokens_per_s": batch.num_tokens / seconds,
            "host_ms": 1e3 * host_s, "wall_ms_from_idle": 1e3 * wall_s,
            "mfu": flops / seconds / PEAK_BF16 if device.type == "cuda" else None, "peak_memory_gb": peak}


def profile_kernels(args, target, experts: str, layer_ids: list[int]) -> dict:
    _, _, forward = feature_forward(args, target, experts, layer_ids)
    with target.compiled_layers(args.compile_target):
        forward()  # a graph compiled for this kernel earlier may need its guards' recompile
        rows = kernel_table(forward, target.device)
    return {"device_ms_profiled": sum(r["ms"] for r in rows), "kinds": by_kind(rows), "top": rows[:args.top]}


def report(name: str, res: dict) -> None:
    mfu = f", MFU {res['mfu']:.3f}" if res["mfu"] is not None else ""
    print(f"\n== {name}: {res['ms']:.1f} ms a forward, {res['tokens_per_s']:,.0f} tokens/s{mfu}; "
          f"profiled {res['device_ms_profiled']:.1f} ms of kernels; from an idle device the call returns "
          f"after {res['host_ms']:.1f} of {res['wall_ms_from_idle']:.1f} ms")
    for kind, v in res["kinds"].items():
        print(f"   {kind:<22} {v['ms']:8.2f} ms  {100 * v['share']:5.1f}%  {v['kernels']:6d} kernels")
    for r in res["top"]:
        print(f"   {r['ms']:8.2f} ms {r['calls']:5d}x  [{r['kind']}] {r['name'][:110]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="random:qwen3-30b-a3b")
    p.add_argument("--device", default="auto")
    p.add_argument("--experts", default="grouped_mm", help=f"comma-separated, from {', '.join(CHOICES)}")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--sequences", type=int, default=1, help="sequences of --seq-len packed in one forward")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--compile-target", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = resolve_device(args.device)
    target = load_target(args.target, device=device, seed=args.seed)
    layer_ids = default_target_layer_ids(target.num_layers, min(5, max(1, target.num_layers - 3)))
    deepest = max(layer_ids) + 1
    flops = target_flops(shape_of(target.config), deepest, [args.seq_len] * args.sequences)
    kernels = [e.strip() for e in args.experts.split(",") if e.strip()] if is_moe(target.model) else ["auto"]
    out = {"target": args.target, "seq_len": args.seq_len, "sequences": args.sequences, "layers_run": deepest,
           "compile_target": args.compile_target,
           "tflop_per_forward": flops / 1e12, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else "cpu", "torch": torch.__version__, "date": str(date.today()),
           "command": "python3 benchmarks/target_profile.py " + " ".join(sys.argv[1:]), "runs": {}}
    # every kernel timed before any is profiled: a torch.profiler session can leave each later launch slower
    for experts in kernels:
        out["runs"][experts] = time_target(args, target, experts, layer_ids, flops)
    for experts in kernels:
        res = out["runs"][experts]
        res.update(profile_kernels(args, target, experts, layer_ids))
        report(f"{args.target} experts={res['experts']}", res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
