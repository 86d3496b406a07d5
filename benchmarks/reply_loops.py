"""How much of a target's greedy reply is a loop, by position in the reply.

A token counts as copy-predictable when the n tokens before it occurred earlier in the same
reply followed by the same token: a drafter that copies the loop gets it right. Training
anchors are spread over whole replies while the eval decodes the first 128 tokens of each, so a
loop-heavy tail raises the train-time estimate of tau without raising the eval's.

    python3 benchmarks/reply_loops.py --dataset sharegpt --limit 24
"""

from __future__ import annotations

import argparse

import torch

from dflash_train.decode import static_lm
from dflash_train.decode.generate import generate
from dflash_train.eval.prompts import load_prompts
from dflash_train.models.chat import render_chat, stop_token_ids
from dflash_train.models.loading import load_target


def copy_predictable(row: list[int], n: int) -> list[bool]:
    """Per position i >= n: whether the n-gram before i was last followed by row[i]."""
    last: dict[tuple[int, ...], int] = {}
    hits = []
    for i in range(n, len(row)):
        key = tuple(row[i - n:i])
        hits.append(last.get(key) == row[i])
        last[key] = row[i]
    return hits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--split", type=int, default=128, help="report positions before and after this one")
    ap.add_argument("--ngram", type=int, default=4)
    args = ap.parse_args(argv)

    target = load_target(args.target, device=args.device)
    prompts = [render_chat(target, m) for m in load_prompts(args.dataset, args.limit)]
    stops = set(stop_token_ids(target))
    lm = static_lm.for_model(target.model)
    if lm is None:
        raise SystemExit(f"{args.target}: no StaticLM for this architecture")
    rows = generate(lm, prompts, args.new_tokens, sorted(stops)).rows
    capped, counts = 0, [[0, 0], [0, 0]]  # [before split, after]: [tokens, copy-predictable]
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in stops), None)
        capped += end is None
        for i, hit in enumerate(copy_predictable(row[:end], args.ngram), start=args.ngram):
            part = counts[i >= args.split]
            part[0] += 1
            part[1] += hit
    print(f"{args.dataset}: {len(rows)} replies, {capped} reach {args.new_tokens} tokens")
    for name, (total, hits) in zip((f"< {args.split}", f">= {args.split}"), counts, strict=True):
        print(f"  positions {name}: {hits}/{total} tokens copy-predictable ({hits / max(total, 1):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
