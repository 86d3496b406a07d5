"""Where one drafter training step spends its device time: its phases, and its kernels by kind.

    python3 benchmarks/drafter_step.py --json OUT.json                # the SmolLM2 recipe's step, one H200, ~1 min
    python3 benchmarks/drafter_step.py --no-compile-masks             # its masks built eagerly (the default before
                                                                      # the recipe compiled them, 2026-12-07)
    python3 benchmarks/drafter_step.py --no-compile-stack             # a compiled call a layer (the default before
                                                                      # the recipe stacked them, 2026-12-07)
    python3 benchmarks/drafter_step.py --target random:tiny --device cpu --num-layers 2 --block-size 4 \\
        --num-anchors 8 --seq-len 64 --token-budget 256 --intermediate-size 128 --num-key-value-heads 4 \\
        --steps 2   # the CPU plumbing

The step is training's (objective/objective.py DFlashObjective and training/update.py Update: blocks
and FlexAttention masks, the draft layers, the LM head + loss chunks, backward, clipping, fused AdamW
under bf16 autocast) on one pack shaped as `bench`'s (--token-budget tokens of --seq-len-token random
sequences, loss on all but their first 10%, --num-anchors per sequence) and random features, the
drafter shaped by the flags (defaults: configs/smollm2-h200.toml's 12-layer B=8 drafter with a
3,072-wide MLP and one sliding-window layer, over random:smollm2-135m). After --warmup steps:
  - --steps steps back to back, no host sync between them: ms a step, block tokens/s, MFU
    (profiling/flops.py's count for this pack, dense BF16 peak);
  - the same steps with CUDA events around each phase (the objective's own spans: masks, draft
    layers, LM head + loss; the update's: backward, optimizer): each phase's device time;
  - one step under torch.profiler, its kernels summed by name and sorted into kinds
    (target_profile.py's KINDS; Inductor's templates here are FlexAttention's kernels).
What the profile may point at, counted on the CPU for the recipe's pack (objective/masks.py mask_tiles):
FlexAttention executed 20M (query, key) pairs a head and layer in its 128-wide tiles for the ~9M the
mask allows, 74% of those tiles partial (the mask evaluated inside); with the context keys padded to
the tile (objective.py key_context) 16.6M, and --attention flex-split's context-only mask 13.2M.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this tree's sources first
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling target_profile.py

from target_profile import by_kind, kernel_table, sync  # noqa: E402

from dflash_train.data.synthetic import SyntheticSequences  # noqa: E402
from dflash_train.devices import resolve_device  # noqa: E402
from dflash_train.models.factory import drafter_config_for, new_drafter  # noqa: E402
from dflash_train.models.loading import load_target  # noqa: E402
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig  # noqa: E402
from dflash_train.pipeline.stream import PackStream  # noqa: E402
from dflash_train.profiling.flops import PEAK_BF16, PackFlops  # noqa: E402
from dflash_train.training.update import Update, cosine_schedule, make_optimizer  # noqa: E402


class PhaseTimer:
    """The objective's and the update's `prof`: CUDA events around every span, summed per name once read."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pairs: dict[str, list] = defaultdict(list)
        self.on = False

    @contextlib.contextmanager
    def span(self, name: str, device: bool = False):
        if not (self.on and self.cuda):
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self.pairs[name].append((start, end))

    def ms(self, steps: int) -> dict[str, float]:
        sync_all = torch.cuda.synchronize if self.cuda else (lambda: None)
        sync_all()
        return {name: sum(s.elapsed_time(e) for s, e in pairs) / steps for name, pairs in self.pairs.items()}


def build(args, device: torch.device):
    target = load_target(args.target, device=device, seed=args.seed)
    dcfg = drafter_config_for(target, num_layers=args.num_layers, block_size=args.block_size, dtype="bfloat16",
                              intermediate_size=args.intermediate_size, num_sliding_layers=args.sliding_layers,
                              sliding_window=args.sliding_window, num_key_value_heads=args.num_key_value_heads)
    drafter = new_drafter(dcfg, args.seed, device).float()
    cuda = device.type == "cuda"
    prof = PhaseTimer(device)
    attention = args.attention if cuda else "dense"  # the tiled kernels need CUDA; the CPU runs the same math dense
    cfg = ObjectiveConfig(num_anchors=args.num_anchors, attention=attention)
    objective = DFlashObjective(drafter, target.embedding_weight, target.lm_head, cfg, prof,
                                compiled_masks=args.compile_masks, embed_scale=target.embed_scale)
    optimizer = make_optimizer(drafter, 1e-4, 0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(10_000, 0.0))
    update = Update(objective, optimizer, scheduler, grad_clip=1.0, prof=prof)
    seqs = args.token_budget // args.seq_len
    data = SyntheticSequences(seqs, args.seq_len, target.vocab_size, args.seed)
    pack = next(iter(PackStream(data, args.token_budget, args.num_anchors, args.seed, 1).packs(1)))
    features = torch.randn(pack.batch.num_tokens, len(dcfg.target_layer_ids) * target.hidden_size,
                           device=device, dtype=target.dtype)
    flops = PackFlops.build(target.model.config, dcfg, list(dcfg.target_layer_ids), target.vocab_size).drafter_of(pack)
    inputs = (pack.batch.to(device), pack.anchors.to(device), features)
    return target, drafter, update, prof, inputs, flops, objective.backend(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="random:smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--intermediate-size", type=int, default=3072)
    p.add_argument("--num-key-value-heads", type=int, help="the draft layers' K/V heads (default: the target's)")
    p.add_argument("--sliding-layers", type=int, default=1)
    p.add_argument("--sliding-window", type=int, default=16)
    p.add_argument("--num-anchors", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=614)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--attention", choices=("auto", "flex", "flex-split", "intervals"), default="auto")  # train's
    p.add_argument("--compile-masks", action=argparse.BooleanOptionalAction, default=True)  # the recipe's
    p.add_argument("--no-compile-drafter", dest="compile_drafter", action="store_false")
    p.add_argument("--compile-stack", action=argparse.BooleanOptionalAction, default=True)  # the recipe's
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    target, drafter, update, prof, inputs, flops, backend = build(args, device)

    def step():
        update.micro(*inputs)
        update.step()

    layers = drafter.compiled_layers(args.compile_drafter and cuda, stack=args.compile_stack)
    with layers:
        for _ in range(args.warmup):
            step()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync(device)
        seconds = (time.perf_counter() - t0) / args.steps
        prof.on = True
        for _ in range(args.steps):
            step()
        phases = prof.ms(args.steps)
        prof.on = False
        rows = kernel_table(step, device)
    block_tokens = inputs[1].numel() * args.block_size
    out = {"config": vars(args), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "torch": torch.__version__, "date": str(date.today()),
           "command": "python3 benchmarks/drafter_step.py " + " ".join(sys.argv[1:]),
           "attention": backend, "ms_per_step": 1e3 * seconds, "block_tokens": block_tokens,
           "target_tokens": inputs[0].num_tokens,
           "tflop_per_step": flops / 1e12, "mfu": flops / seconds / PEAK_BF16 if cuda else None,
           "phases_ms": phases, "device_ms_profiled": sum(r["ms"] for r in rows), "kinds": by_kind(rows),
           "top": rows[:args.top]}
    mfu = f", MFU {out['mfu']:.3f}" if cuda else ""
    print(f"{1e3 * seconds:.1f} ms a step ({inputs[0].num_tokens / seconds:,.0f} target tokens/s, "
          f"{block_tokens} block tokens, {flops / 1e12:.2f} TFLOP{mfu}; attention {backend})")
    for name, ms in phases.items():
        print(f"   phase {name:<22} {ms:8.2f} ms")
    for kind, v in out["kinds"].items():
        print(f"   {kind:<22} {v['ms']:8.2f} ms  {100 * v['share']:5.1f}%  {v['kernels']:6d} kernels")
    for r in out["top"]:
        print(f"   {r['ms']:8.2f} ms {r['calls']:5d}x  [{r['kind']}] {r['name'][:110]}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
