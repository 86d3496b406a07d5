"""What a batch-1 eval spends per prompt beyond its DFlash steps (the T=0 device loop, eval's path).

    python3 benchmarks/eval_overhead.py --draft-layers 12 --block-size 8 --json OUT.json

`eval` divides its decode time by its steps. The device loop's steps replay as CUDA graphs
(`benchmarks/decode_speed.py`: ~5 ms for a 12-layer B=8 drafter on SmolLM2-135M, an H200), but
each prompt also pays a first step, graph captures of key-length buckets the warm-up did not
reach, and the syncs that read steps back. A real eval at tau 2.5 runs ~43 steps per prompt
(128 new tokens), so a per-prompt cost of 40 ms adds ~1 ms to every step. This measures it with
random weights (a random drafter accepts nothing: one token per step), prompts of HumanEval's
chat-templated lengths (93-321 tokens) and --new-tokens steps each:
- `eval`: `evaluate()` as the CLI runs it (its warm-up included, outside the clock): ms per
  DFlash step and per target-only token;
- `back_to_back`: the same steps with no host sync between them (the GPU's share);
- `per_prompt_ms`: eval's decode time less back-to-back steps, per prompt;
- `first_step_ms`: the first step alone (after the prefill), wall time to a sync, median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
from decode_speed import _sync, device_steps  # a sibling script: benchmarks/ is sys.path[0]

from dflash_train.decode import greedy_loop
from dflash_train.eval.evaluate import EvalConfig, evaluate
from dflash_train.files import write_atomic
from dflash_train.models.factory import drafter_config_for, new_drafter
from dflash_train.models.loading import load_target


def _prompts(n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in lengths]


def first_step_ms(target, drafter, prompts: list[list[int]], new_tokens: int) -> float:
    loop = greedy_loop.for_pair(target, drafter)
    times = []
    for p in prompts:
        loop.start(p, new_tokens)  # host sync inside (the first token)
        t0 = time.perf_counter()
        loop.first_step()
        _sync(target.device)
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="random:smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--draft-layers", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--prompt-min", type=int, default=93)
    ap.add_argument("--prompt-max", type=int, default=321)
    ap.add_argument("--new-tokens", type=int, default=43, help="tokens (= steps at tau 1) per prompt")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    target = load_target(args.target, device=dev)
    drafter = new_drafter(drafter_config_for(target, num_layers=args.draft_layers, block_size=args.block_size), 0,
                          dev).to(target.dtype).eval()
    prompts = _prompts(args.prompts, args.prompt_min, args.prompt_max, min(len(target.tokenizer), target.vocab_size))
    report = evaluate(target, drafter, prompts, EvalConfig(max_new_tokens=args.new_tokens), progress=False)
    step_ms = 1e3 * (report.generated_tokens - len(prompts)) / report.dflash_tokens_per_s / report.steps
    b2b = device_steps(target, drafter, prompts[0])["ms_per_step"]
    out = {
        "target": args.target, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "date": date.today().isoformat(), "torch": torch.__version__,
        "command": "python3 benchmarks/eval_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "draft_layers": args.draft_layers, "block_size": args.block_size, "prompts": len(prompts),
        "steps": report.steps, "tau": round(report.tau, 3),
        "eval_ms_per_step": round(step_ms, 3),
        "eval_target_ms_per_token": round(1e3 / report.target_tokens_per_s, 3),
        "back_to_back_ms_per_step": b2b,
        "per_prompt_ms": round((step_ms - b2b) * report.steps / len(prompts), 2),
        "first_step_ms": first_step_ms(target, drafter, prompts[:10], args.new_tokens),
    }
    text = json.dumps(out, indent=1) + "\n"
    print(text, end="")
    if args.json:
        write_atomic(Path(args.json), lambda f: f.write(text.encode()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
