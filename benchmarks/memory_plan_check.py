"""The memory plan against what a GPU measures: weights and one feature forward's peak, per preset.

    python3 benchmarks/memory_plan_check.py --presets qwen3-8b,qwen3-30b-a3b,gpt-oss-20b --tokens 8192 \
        [--features 5] [--json OUT]

For each `random:` preset (bf16, one GPU, the loader `train` uses) it prints the plan's weights and
activations (models/memory_plan.py) beside the measured ones:
    weights      torch.cuda.memory_allocated after loading, less before
    activations  torch.cuda.max_memory_allocated over one `--tokens` sequence's feature forward
                 (the last `--features` layers captured), less what was allocated before it
The plan should be at or above the measured activations by at most 15% (it errs on the safe side) and
within 15% of the weights. CUDA only: on a CPU tests/test_memory_plan.py measures the resident set.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from dflash_train.data.packing import PackedBatch
from dflash_train.models.loading import load_target
from dflash_train.models.memory_plan import plan_memory
from dflash_train.pipeline.features import packed_features


def one_sequence(n: int, vocab: int) -> PackedBatch:
    return PackedBatch(torch.randint(0, vocab, (n,)), torch.ones(n, dtype=torch.long),
                       torch.zeros(n, dtype=torch.long), torch.arange(n))


def measure(preset: str, tokens: int, n_features: int) -> dict:
    dev = torch.device("cuda")
    before = torch.cuda.memory_allocated(dev)
    target = load_target(f"random:{preset}", device=dev, dtype=torch.bfloat16)
    weights = torch.cuda.memory_allocated(dev) - before
    layers = list(range(target.num_layers - n_features, target.num_layers))
    vocab = target.model.config.vocab_size
    packed_features(target, one_sequence(256, vocab), layers)  # first-call allocations (kernels, workspaces)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    feats = packed_features(target, one_sequence(tokens, vocab), layers)
    torch.cuda.synchronize(dev)
    activations = torch.cuda.max_memory_allocated(dev) - base
    plan = plan_memory(target.model.config, tp=1, device_bytes=1e13, token_budget=tokens, n_features=n_features)
    del feats, target
    gc.collect()
    torch.cuda.empty_cache()
    return {"preset": preset, "tokens": tokens, "features": n_features,
            "weights_gb": weights / 1e9, "plan_weights_gb": plan.weights / 1e9,
            "activations_gb": activations / 1e9, "plan_activations_gb": plan.activations / 1e9,
            "activations_over": plan.activations / activations - 1}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="qwen3-8b,qwen3-30b-a3b,gpt-oss-20b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--features", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("memory_plan_check: needs a CUDA GPU (tests/test_memory_plan.py measures on a CPU)", file=sys.stderr)
        return 2
    rows = []
    for preset in args.presets.split(","):
        r = measure(preset, args.tokens, args.features)
        rows.append(r)
        over = 100 * r["activations_over"]
        print(f"{preset}: weights {r['weights_gb']:.2f} GB (plan {r['plan_weights_gb']:.2f}), activations "
              f"{r['activations_gb']:.2f} GB (plan {r['plan_activations_gb']:.2f}, {over:+.1f}%)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
