"""What lands on the eval's clock: every CUDA-graph capture and Triton compile during `evaluate()`, tagged with
the warm-up or the timed prompt it fell in, and the DFlash decode's ms a verify step beside the target-only
decode's ms a token.

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/eval_clock.py --json OUT.json     # one GPU, ~1 min
    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/eval_clock.py --warm prompt-buckets --json OUT.json
    python3 benchmarks/eval_clock.py --device cpu --target random:tiny --layers 1 --prompts 3 --new-tokens 16

The prompts have the token counts of the SmolLM2 recipe's 40 HumanEval prompts through its chat template (random
ids), the drafter the recipe's shape (12 layers, B=8, one sliding layer of 16, an MLP twice the target's), with
random weights: tau ~1, so ~128 steps a prompt where a trained drafter takes ~34. A fresh TRITON_CACHE_DIR makes
the compiles those of a fresh machine. --warm prompt-buckets warms as the eval did before it covered the drafter's
prompt pass (the shortest prompt of each 128-token prompt bucket only): what that left on the clock.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this tree's code, whatever is installed

from dflash_train.decode import graphs  # noqa: E402
from dflash_train.decode.static_lm import bucket  # noqa: E402
from dflash_train.eval import evaluate as ev  # noqa: E402
from dflash_train.models.factory import drafter_config_for, new_drafter  # noqa: E402
from dflash_train.models.loading import load_target  # noqa: E402

# HumanEval's first 40 prompts through SmolLM2-135M-Instruct's chat template (eval/prompts.py): token counts
LENGTHS = [177, 170, 133, 167, 170, 147, 168, 154, 166, 152, 211, 136, 153, 125, 110, 123, 127, 219, 146, 158, 222,
           179, 145, 93, 102, 177, 139, 101, 111, 146, 170, 156, 321, 200, 125, 137, 138, 173, 218, 145]


class Events:
    """Graph captures (graphs._capture) and Triton compiles (JITFunction._do_compile), timed, each tagged with
    the phase it fell in; `inner` marks one inside another (a compile in a capture's eager run), whose time
    the outer one already holds."""

    def __init__(self) -> None:
        self.phase, self.rows, self.depth = "setup", [], 0
        capture = graphs._capture

        def timed_capture(store, fn, inputs, device):
            return self._timed("graph capture", [tuple(x.shape) for x in inputs], capture, store, fn, inputs, device)
        graphs._capture = timed_capture
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:  # no Triton: captures only
            return
        compile_ = JITFunction._do_compile

        def timed_compile(fn, key, signature, device, constexprs, *a, **k):
            # the constants, then the arguments' specialisations (alignment, divisibility by 16; Triton 3.x
            # passes them as `attrs` after the options): two compiles of one kernel differ in one or the other
            attrs = k.get("attrs", a[1] if len(a) > 1 else None)
            detail = f"{str(constexprs)[:160]} {str(attrs)[:400]}" if attrs is not None else str(constexprs)[:160]
            return self._timed(f"triton compile {fn.fn.__name__}", detail, compile_, fn, key,
                               signature, device, constexprs, *a, **k)
        JITFunction._do_compile = timed_compile

    def _timed(self, what: str, detail, call, *args, **kwargs):
        t0, inner = time.perf_counter(), self.depth > 0
        self.depth += 1
        try:
            out = call(*args, **kwargs)
        finally:
            self.depth -= 1
        self.rows.append({"phase": self.phase, "what": what, "ms": round(1e3 * (time.perf_counter() - t0), 1),
                          "inner": inner, "detail": detail})
        return out


def prompt_buckets(prompts: list[list[int]], block_size: int, max_new_tokens: int,
                   size: int = 128) -> list[list[int]]:
    """The warm-up by prompt buckets alone: the longest prompt, then the shortest of each other bucket."""
    longest = max(prompts, key=len)
    shortest: dict[int, list[int]] = {}
    for p in sorted(prompts, key=len):
        shortest.setdefault(bucket(len(p), size), p)
    return [longest] + [p for b, p in sorted(shortest.items()) if b != bucket(len(longest), size)]


def timed_eval(target, drafter, prompts: list[list[int]], new_tokens: int, events: Events) -> dict:
    """evaluate() as the train job runs it, its timed decodes tagged; DFlash ms a step over those decodes."""
    runs, calls = [], [0]
    real = ev.speculative_generate
    cuda = target.device.type == "cuda"
    warm = len(ev.warm_prompts(prompts, drafter.block_size, new_tokens)) if cuda else 1  # evaluate's

    def tagged(t, d, prompt, *a, **k):
        calls[0] += 1
        timed = calls[0] > warm
        events.phase = f"timed prompt {len(runs)} (len {len(prompt)})" if timed else "warm-up"
        r = real(t, d, prompt, *a, **k)
        if timed:
            runs.append(r)
        return r
    ev.speculative_generate = tagged
    try:
        rep = ev.evaluate(target, drafter, prompts, ev.EvalConfig(max_new_tokens=new_tokens), progress=False)
    finally:
        ev.speculative_generate, events.phase = real, "after"
    steps, seconds = sum(len(r.committed) for r in runs), sum(r.decode_s for r in runs)
    return {"tau": round(rep.tau, 3), "steps": steps, "dflash_ms_per_step": round(1e3 * seconds / steps, 4),
            "target_ms_per_token": round(1e3 / rep.target_tokens_per_s, 4), "phases_s": rep.phases_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="random:smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=len(LENGTHS))
    p.add_argument("--warm", choices=("full", "prompt-buckets"), default="full")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    events = Events()
    target = load_target(args.target, device=device)
    cfg = drafter_config_for(target, num_layers=args.layers, block_size=args.block_size, num_sliding_layers=1,
                             sliding_window=16, intermediate_size=2 * target.config.intermediate_size)
    drafter = new_drafter(cfg, 0, device).to(target.dtype).eval()
    vocab = min(len(target.tokenizer), target.vocab_size)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS[:args.prompts]]
    if args.warm == "prompt-buckets":
        ev.warm_prompts = prompt_buckets
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "command": "python3 benchmarks/eval_clock.py " + " ".join(sys.argv[1:]),
           "eval": timed_eval(target, drafter, prompts, args.new_tokens, events), "events": events.rows}
    print("eval:", json.dumps(res["eval"]))
    print("outside the timed prompts:", dict(Counter((e["phase"], e["what"]) for e in events.rows
                                                     if not e["phase"].startswith("timed"))))
    timed = [e for e in events.rows if e["phase"].startswith("timed")]
    print(f"on the clock: {len(timed)} events, {sum(e['ms'] for e in timed if not e['inner']):.1f} ms")
    for e in timed:
        inner = " (inside the next)" if e["inner"] else ""
        print(f"  {e['phase']:<28} {e['what'] + inner:<54} {e['ms']:8.1f} ms  {e['detail']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
