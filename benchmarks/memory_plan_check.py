"""The memory plan against what a GPU measures: weights and one feature forward's peak, per preset.

    python3 benchmarks/memory_plan_check.py --presets qwen3-8b,qwen3-30b-a3b,gpt-oss-20b --tokens 8192 \
        [--features 5] [--device cuda|cpu] [--experts auto|grouped_mm|...] [--json OUT]

For each `random:` preset (bf16 on a GPU, float32 on a CPU; the loader `train` uses) it prints the
plan's weights and activations (models/memory_plan.py) beside the measured ones:
    weights      bytes allocated after loading, less before
    activations  the peak over one `--tokens` sequence's feature forward (the last `--features`
                 layers captured), less what was allocated before it
CUDA's allocator counts the bytes; on a CPU the process's resident set (VmRSS, and VmHWM reset through
/proc/self/clear_refs) does, coarser: run it with MALLOC_MMAP_THRESHOLD_=65536 so freed blocks leave
at once (tests/test_memory_plan.py holds a CPU measurement to the plan). The plan should be at or
above the measured activations by at most 15% (it errs on the safe side) and within 15% of the weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from dflash_train.data.packing import PackedBatch
from dflash_train.models.experts import CHOICES, use_experts
from dflash_train.models.loading import load_target
from dflash_train.models.memory_plan import plan_memory
from dflash_train.pipeline.features import packed_features


def one_sequence(n: int, vocab: int) -> PackedBatch:
    return PackedBatch(torch.randint(0, vocab, (n,)), torch.ones(n, dtype=torch.long),
                       torch.zeros(n, dtype=torch.long), torch.arange(n))


class Meter:
    """Allocated bytes and their peak since the last reset: CUDA's allocator, or a CPU process's resident set."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def allocated(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return _status("VmRSS:")

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak resident set (VmHWM) to the current one

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _status("VmHWM:")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def measure(preset: str, tokens: int, n_features: int, device: torch.device, experts: str = "auto") -> dict:
    meter, dtype = Meter(device), torch.bfloat16 if device.type == "cuda" else torch.float32
    before = meter.allocated()
    target = load_target(f"random:{preset}", device=device, dtype=dtype)
    weights = meter.allocated() - before
    kernel = use_experts(target.model, experts)  # None for a dense target
    layers = list(range(target.num_layers - n_features, target.num_layers))
    vocab = target.model.config.vocab_size
    packed_features(target, one_sequence(256, vocab), layers)  # first-call allocations (kernels, workspaces)
    base = meter.allocated()
    meter.reset_peak()
    feats = packed_features(target, one_sequence(tokens, vocab), layers)
    activations = meter.peak() - base
    plan = plan_memory(target.model.config, tp=1, device_bytes=1e13, token_budget=tokens, n_features=n_features,
                       dtype=dtype)
    del feats, target
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"preset": preset, "tokens": tokens, "features": n_features, "experts": kernel,
            "weights_gb": weights / 1e9, "plan_weights_gb": plan.weights / 1e9,
            "activations_gb": activations / 1e9, "plan_activations_gb": plan.activations / 1e9,
            "activations_over": plan.activations / activations - 1}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="qwen3-8b,qwen3-30b-a3b,gpt-oss-20b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--features", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--experts", default="auto", choices=CHOICES, help="a MoE target's experts kernel (train's "
                   "--target-experts): the routed rows' transients differ between them")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("memory_plan_check: --device cuda: no CUDA GPU here (--device cpu measures the resident set)",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cpu":  # imports and lazy modules grow the resident set once: not the first preset's weights
        del load_target("random:tiny", device=device, dtype=torch.float32).model
    rows = []
    for preset in args.presets.split(","):
        r = measure(preset, args.tokens, args.features, device, args.experts)
        rows.append(r)
        over = 100 * r["activations_over"]
        print(f"{preset}: weights {r['weights_gb']:.2f} GB (plan {r['plan_weights_gb']:.2f}), activations "
              f"{r['activations_gb']:.2f} GB (plan {r['plan_activations_gb']:.2f}, {over:+.1f}%)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
            json.dump({"device": name, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
