"""What regeneration's decode steps read: KV slots per step, batches in selection order or sorted per turn.

    python3 benchmarks/regen_widths.py [--batch-size 2048 --max-turns 3 --max-new-tokens 256 --json OUT.json]
    python3 benchmarks/regen_widths.py --target random:tiny --limit 200 --batch-size 16   # a check of the script

A regeneration batch decodes every row over its widest prompt: each step's attention reads
rows x (width + tokens so far) KV slots, and at 2,048 rows of SmolLM2 those reads, not the weights,
are most of a step's bytes. Selection sorts conversations by their first prompt, so turn 1's batches
are tight; a later turn's prompt holds the whole history (replies and user turns of any length), so
batches in selection order are as wide as their longest history. `data/regenerate.py` now sorts each
turn's prompts across a pool of 4 batches. This counts the slots both ways on the shipped config's
data (all of ShareGPT's train split whose first prompt fits 512 tokens), without a GPU: reply
lengths stand in by the original ShareGPT replies' token counts, capped at --max-new-tokens (the
target's own replies run to the cap 70% of the time on this data), and a batch runs until its
longest reply ends. CPU, ~2 minutes (tokenizing 12K conversations).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

from dflash_train.data.regen_common import reply_segments
from dflash_train.data.regenerate import POOL_BATCHES
from dflash_train.data.selection import select_conversations
from dflash_train.data.sources import SourceReport, iter_conversations
from dflash_train.models.loading import load_target

TEMPLATE_TOKENS = 5  # a chat message's role header and end-of-turn tokens in SmolLM2's template


def selected_turns(args) -> tuple[list, list[list[int]], list[list[int]]]:
    """ShareGPT's train conversations as the recipe selects them (all topics, first prompts of up to
    args.max_prompt_tokens, the first args.limit), with their turns' prompt and reply lengths in
    args.target's tokens (turn_lengths)."""
    target = load_target(args.target, device="cpu")
    report = SourceReport()
    convs = select_conversations(iter_conversations("sharegpt", split="train", on_bad="skip", report=report), report,
                                 topic="any", limit=args.limit, target=target, max_prompt_tokens=args.max_prompt_tokens)
    return convs, *turn_lengths(target.tokenizer, convs, args.max_turns, args.max_new_tokens)


def turn_lengths(tokenizer, convs, turns: int, max_new: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per conversation: tokens of each reply's new prompt segment, and of each reply (capped)."""
    segs = [reply_segments(c, turns) for c in convs]
    flat = [m["content"] for s in segs for seg in s for m in seg]
    lens = iter(len(x) for x in tokenizer(flat, add_special_tokens=False)["input_ids"])
    prompts = [[sum(next(lens) + TEMPLATE_TOKENS for _ in seg) for seg in s] for s in segs]
    answers = [[m["content"] for m in c.messages if m["role"] == "assistant"][:turns] for c in convs]
    rl = iter(len(x) for x in tokenizer([a for ans in answers for a in ans], add_special_tokens=False)["input_ids"])
    replies = [[min(max_new, next(rl) + 1) for _ in ans] for ans in answers]
    return prompts, replies


def kv_slots(prompts, replies, batch: int, turns: int, max_context: int, sort: bool,
             pool_batches: int = POOL_BATCHES) -> tuple[int, int]:
    """(slots read, slots a row's own tokens need) over every decode step of every turn."""
    read = useful = 0
    history = [0] * len(prompts)
    for k in range(turns):
        pool = []
        for i, (p, r) in enumerate(zip(prompts, replies, strict=True)):
            if k < min(len(p), len(r)) and not (k and history[i] + p[k] >= max_context):
                pool.append((history[i] + p[k], r[k], i))
        for start in range(0, len(pool), batch * pool_batches):
            chunk = pool[start:start + batch * pool_batches]
            chunk = sorted(chunk) if sort else chunk
            for b in range(0, len(chunk), batch):
                rows = chunk[b:b + batch]
                width, steps = max(p for p, _, _ in rows), max(r for _, r, _ in rows)
                read += len(rows) * (steps * width + steps * (steps - 1) // 2)
                useful += sum(r * p + r * (r - 1) // 2 for p, r, _ in rows)
        for p, r, i in pool:
            history[i] = p + r
    return read, useful


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=1, help="reply chains per conversation (--regen-samples)")
    ap.add_argument("--pool-batches", type=int, nargs="+", default=[POOL_BATCHES],
                    help="batches sorted together per turn (data/regenerate.py's POOL_BATCHES): one count each")
    ap.add_argument("--target", default="smollm2-135m", help="whose tokenizer counts the tokens")
    ap.add_argument("--limit", type=int, default=0, help="the first N conversations selected (default 0: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    convs, prompts, replies = selected_turns(args)
    # sampled chains of one conversation share its prompts; their lengths stand in as equal
    prompts, replies = ([x for x in xs for _ in range(args.samples)] for xs in (prompts, replies))
    out = {"conversations": len(convs), "samples": args.samples, "batch_size": args.batch_size,
           "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens, "date": date.today().isoformat(),
           "note": "counted on the CPU, not timed: KV slots the decode steps' attention reads (reply lengths from "
                   "the original replies, capped), batches in selection order against sorted per turn",
           "command": "python3 benchmarks/regen_widths.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    runs = [("selection_order", False, POOL_BATCHES)] + [
        ("sorted_per_turn" + (f"_pool_{n}" if len(args.pool_batches) > 1 else ""), True, n) for n in args.pool_batches]
    for name, sort, pool in runs:
        read, useful = kv_slots(prompts, replies, args.batch_size, args.max_turns, args.max_context, sort, pool)
        out[name] = {"kv_slots_read": read, "useful_share": round(useful / read, 3), "pool_batches": pool}
        print(f"{name:24s} KV slots read {read / 1e9:.2f}G, {useful / read:.0%} of them a row's own")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
