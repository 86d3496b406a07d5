"""The eval's replay (training/replay.py): its prompts one at a time against packed, on the same outputs.

    python3 benchmarks/replay_speed.py                                            # CPU, the tiny target
    python3 benchmarks/replay_speed.py --device cuda --target random:smollm2-135m --layers 12 --prompts 40 \\
        --json OUT.json                                                           # the recipe's eval shape

One at a time, each prompt takes a target forward and a drafter forward for each block width its anchors need (up to
B, where the output reaches the token limit); packed, prompts of similar lengths share them. Random weights and
random tokens: the work is the same whatever the drafts accept. Prints both times and checks the runs are equal.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_train.models.factory import drafter_config_for, new_drafter
from dflash_train.models.loading import load_target
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig
from dflash_train.training.replay import accepted_runs, packed_runs


def timed(fn, device: torch.device) -> tuple[float, list]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--target", default="random:tiny")
    p.add_argument("--layers", type=int, default=2, help="draft layers")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=32, help="output tokens a prompt (the eval's max_new_tokens)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    target = load_target(args.target, device=device)
    dcfg = drafter_config_for(target, num_layers=args.layers, block_size=args.block_size,
                              dtype=str(target.dtype).removeprefix("torch."))
    drafter = new_drafter(dcfg, 0, device).to(target.dtype).eval()
    obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head, ObjectiveConfig(attention="dense"),
                          embed_scale=target.embed_scale)
    g = torch.Generator().manual_seed(0)
    vocab = target.embedding_weight.shape[0]
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.prompts,), generator=g).tolist()
    pairs = [(torch.randint(3, vocab, (n,), generator=g).tolist(),
              torch.randint(3, vocab, (args.new_tokens,), generator=g).tolist()) for n in lengths]
    n = args.new_tokens
    with torch.no_grad():
        [accepted_runs(target, obj, *pair, n) for pair in pairs[:2]]  # warm-up: first-call allocations, kernels
        packed_runs(target, obj, pairs[:2], n)
        one_s, one = timed(lambda: [accepted_runs(target, obj, *pair, n) for pair in pairs], device)
        packed_s, packed = timed(lambda: packed_runs(target, obj, pairs, n), device)
    same = sum(a == b for a, b in zip(one, packed, strict=True))
    print(f"{args.prompts} prompts of {args.prompt_min}-{args.prompt_max} tokens, {n} output tokens each: "
          f"one at a time {one_s:.2f} s, packed {packed_s:.2f} s ({one_s / packed_s:.1f}x); "
          f"runs equal for {same} of {args.prompts} prompts")
    if args.json:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        out = {"device": name, "torch": torch.__version__, "args": vars(args), "one_at_a_time_s": one_s,
               "packed_s": packed_s, "prompts_equal": same}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
