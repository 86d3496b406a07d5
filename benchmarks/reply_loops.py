"""How much of a target's reply is a loop or a copy of its prompt, by position in the reply.

A token counts as copy-predictable when the n tokens before it occurred earlier in the same
reply followed by the same token: a drafter that copies the loop gets it right; "with the prompt"
counts n-grams of the prompt too (a reply that repeats its prompt). Training anchors are spread
over whole replies while the eval decodes the first 128 tokens of each, so a loop-heavy tail
raises the train-time estimate of tau without raising the eval's. "Far" copies reach back at least
--far tokens (a reply repeating a long prompt). --temperature samples the replies as regeneration
does (the training data) instead of the eval's greedy decode.

    python3 benchmarks/reply_loops.py --dataset sharegpt --limit 24 [--target gemma3-270m --temperature 0.7]
"""

from __future__ import annotations

import argparse

import torch

from dflash_train.decode import static_lm
from dflash_train.decode.generate import Picker, generate, until_stop
from dflash_train.decode.sampling import greedy, pick
from dflash_train.eval.lookup import lookup_tau
from dflash_train.eval.prompts import load_prompts
from dflash_train.models.chat import render_chat, stop_token_ids
from dflash_train.models.loading import load_target


def copy_back(row: list[int], n: int, start: int = 0) -> list[int | None]:
    """Per position i >= max(n, start): how far back the n-gram before i last occurred, if that occurrence was
    followed by row[i] (None: never seen, or followed by another token); the n-grams of row[:start], a
    prompt, count as seen."""
    last: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
    for i in range(n, min(start, len(row))):
        last[tuple(row[i - n:i])] = i
    back = []
    for i in range(max(n, start), len(row)):
        key = tuple(row[i - n:i])
        j = last.get(key)
        back.append(i - j if j is not None and row[j] == row[i] else None)
        last[key] = i
    return back


def copy_predictable(row: list[int], n: int, start: int = 0) -> list[bool]:
    """Per position i >= max(n, start): whether the n-gram before i was last followed by row[i] (the n-grams
    of row[:start], a prompt, count as seen)."""
    return [d is not None for d in copy_back(row, n, start)]


def add_reply_args(ap: argparse.ArgumentParser, limit: int, new_tokens: int) -> None:
    """The flags of a script that reads an eval set's prompts and the target's replies (eval_replies)."""
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--limit", type=int, default=limit)
    ap.add_argument("--new-tokens", type=int, default=new_tokens)


def eval_replies(target, dataset: str, limit: int, new_tokens: int,
                 picker: Picker = greedy) -> tuple[list[list[int]], list[list[int]]]:
    """An eval set's first `limit` prompts rendered for the target, and the target's reply to each (at most
    new_tokens, cut after its first stop token), decoded together on a StaticLM."""
    lm = static_lm.for_model(target.model)
    if lm is None:
        raise SystemExit(f"{target.spec}: no StaticLM for this architecture")
    prompts = [render_chat(target, m) for m in load_prompts(dataset, limit)]
    stops = set(stop_token_ids(target))
    rows = generate(lm, prompts, new_tokens, sorted(stops), picker).rows
    return prompts, [until_stop(r, stops) for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_reply_args(ap, limit=24, new_tokens=256)
    ap.add_argument("--split", type=int, default=128, help="report positions before and after this one")
    ap.add_argument("--ngram", type=int, default=4)
    ap.add_argument("--far", type=int, default=64, help="a copy from at least this many tokens back counts as far")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the eval's); > 0: sampled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=8, help="prompt lookup's block (its tau over the first --split)")
    args = ap.parse_args(argv)

    target = load_target(args.target, device=args.device)
    gen = torch.Generator(device=target.device).manual_seed(args.seed)
    prompts, replies = eval_replies(target, args.dataset, args.limit, args.new_tokens,
                                    lambda x: pick(x, args.temperature, gen))
    stops = set(stop_token_ids(target))
    capped, counts = 0, [[0, 0, 0, 0], [0, 0, 0, 0]]  # [before split, after]: [tokens, in-reply, with the prompt, far]
    for prompt, reply in zip(prompts, replies, strict=True):
        capped += not reply or reply[-1] not in stops
        both = copy_back(prompt + reply, args.ngram, len(prompt) + args.ngram)  # reply positions n..
        for i, (hit, back) in enumerate(zip(copy_predictable(reply, args.ngram, 0), both, strict=True),
                                        start=args.ngram):
            part = counts[i >= args.split]
            part[0] += 1
            part[1] += hit
            part[2] += back is not None
            part[3] += back is not None and back >= args.far
    print(f"{args.target} {args.dataset} T={args.temperature:g}: {len(replies)} replies, {capped} reach "
          f"{args.new_tokens} tokens")
    for name, (total, hits, any_hits, far) in zip((f"< {args.split}", f">= {args.split}"), counts, strict=True):
        print(f"  positions {name}: copy-predictable {hits}/{total} in the reply ({hits / max(total, 1):.2f}), "
              f"{any_hits}/{total} with the prompt ({any_hits / max(total, 1):.2f}), of which from >= {args.far} "
              f"tokens back {far}/{total} ({far / max(total, 1):.2f})")
    tau = lookup_tau(prompts, [r[:args.split] for r in replies], args.block_size)
    print(f"  prompt lookup over positions < {args.split} (eval/lookup.py, B={args.block_size}): tau {tau:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
