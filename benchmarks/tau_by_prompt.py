"""Where an eval's tau comes from, prompt by prompt: its length, and where and how far back its reply copies from.

Reads an eval record (RUN/eval_after.json, or `dflash-train eval --json`), decodes the same prompts
greedily with the target (the eval's tokens up to ties and the dtype's rounding: give the eval's
--dtype) and gives, for each prompt, the drafter's tau beside:
  prompt       the rendered prompt's tokens;
  copy_prompt  the share of reply tokens whose 4-gram continuation last occurred in the prompt;
  copy_reply   the share whose continuation last occurred earlier in the reply (a loop);
  copy_dist    the median distance back of those copies, in tokens;
  lookup       prompt lookup's tau on that reply (eval/lookup.py: its own matching rule, up to 3-grams);
  replay       the record's per-prompt tau_replay, where it has one (the training path on the same outputs).
Then the mean tau by prompt length (thirds) and the correlation of tau with each column. Greedy
replies that repeat their prompt copy from further back the longer it is, so prompt length and copy
distance go together: a tau that falls with both while lookup's holds says the drafter misses
long-range copies, whether it never learned them or the decode path differs from training on long
contexts (the replay column tells which: beside tau, the drafter's own; above it, the decode path).

    python3 benchmarks/tau_by_prompt.py --target gemma3-270m --record RUN/eval_after.json --dataset humaneval"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

# Run from a checkout without installing: the working tree's sources come first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling reply_loops.py

from record_json import write_json  # noqa: E402
from reply_loops import eval_replies  # noqa: E402

from dflash_train.eval.lookup import lookup_tau  # noqa: E402
from dflash_train.models.checkpoint import parse_dtype  # noqa: E402
from dflash_train.models.loading import load_target  # noqa: E402

NGRAM = 4  # the n-gram whose continuation counts as a copy


def copy_distances(seq: list[int], start: int, n: int = NGRAM) -> list[int | None]:
    """Per position i > start + n - 1 of seq (the reply's, after its first n tokens): how far back the n-gram
    ending at i - 1 last occurred followed by seq[i] (None: never). Earlier occurrences in the prompt count."""
    last: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ends of its occurrences, latest last
    out: list[int | None] = []
    for i in range(n, len(seq)):
        key = tuple(seq[i - n:i])
        if i >= start + n:
            hit = next((i - e for e in reversed(last.get(key, [])) if seq[e] == seq[i]), None)
            out.append(hit)
        last.setdefault(key, []).append(i)
    return out


def prompt_rows(taus: list[float], prompts: list[list[int]], replies: list[list[int]], block_size: int,
                replays: list[float] | None = None) -> list[dict]:
    """One row per prompt; with `replays` (the record's per_prompt_tau_replay) each row's replayed tau too."""
    if replays is not None and len(replays) != len(taus):
        raise SystemExit(f"the record has {len(replays)} replayed taus for {len(taus)} prompts")
    rows = []
    for i, (tau, prompt, reply) in enumerate(zip(taus, prompts, replies, strict=True)):
        dists = copy_distances(prompt + reply, len(prompt))
        # position k of dists is reply token k + NGRAM; a copy reaching back past the reply's start is the prompt's
        sources = [None if d is None else d > k + NGRAM for k, d in enumerate(dists)]
        n, copied = max(len(dists), 1), [d for d in dists if d is not None]
        rows.append({"tau": round(tau, 3), "prompt": len(prompt), "reply": len(reply),
                     "copy_prompt": round(sum(x is True for x in sources) / n, 3),
                     "copy_reply": round(sum(x is False for x in sources) / n, 3),
                     "copy_dist": statistics.median(copied) if copied else None,
                     "lookup": round(lookup_tau([prompt], [reply], block_size), 3)})
        if replays is not None:
            rows[-1]["replay"] = round(replays[i], 3)
    return rows


def thirds(rows: list[dict]) -> list[list[dict]]:
    """The rows by prompt length in three parts as equal as the count allows (empty ones for fewer than 3)."""
    by_len, n = sorted(rows, key=lambda r: r["prompt"]), len(rows)
    return [by_len[i * n // 3:(i + 1) * n // 3] for i in range(3)]


DIST_BINS = (0, 32, 64, 128)  # copy distances, tokens: [0, 32), [32, 64), [64, 128), 128 and more


def means(rows: list[dict]) -> dict:
    cols = ("tau", "replay", "lookup") if all("replay" in r for r in rows) else ("tau", "lookup")
    return {"prompts": len(rows), **{c: round(statistics.mean(r[c] for r in rows), 3) for c in cols}}


def summary(rows: list[dict]) -> dict:
    """Mean tau (and lookup's) by prompt-length third and, over the prompts whose replies are mostly copies, by
    their median copy distance; and tau's correlation with each column."""
    out = {"tau_by_prompt_third": [{"prompt": [t[0]["prompt"], t[-1]["prompt"]], **means(t)} if t else None
                                   for t in thirds(rows)]}
    copying = [r for r in rows if r["copy_dist"] is not None and r["copy_prompt"] + r["copy_reply"] > 0.5]
    out["tau_by_copy_dist"] = []
    for lo, hi in zip(DIST_BINS, (*DIST_BINS[1:], None), strict=True):
        part = [r for r in copying if lo <= r["copy_dist"] and (hi is None or r["copy_dist"] < hi)]
        if part:
            out["tau_by_copy_dist"].append({"copy_dist": [lo, hi], **means(part)})
    for col in ("prompt", "copy_prompt", "copy_reply", "copy_dist", "lookup"):
        pairs = [(r[col], r["tau"]) for r in rows if r[col] is not None]
        xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
        ok = len(pairs) > 2 and len(set(xs)) > 1 and len(set(ys)) > 1
        out[f"corr_tau_{col}"] = round(statistics.correlation(xs, ys), 3) if ok else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--record", required=True, help="an eval record with per_prompt_tau (RUN/eval_after.json)")
    ap.add_argument("--dataset", default="humaneval", help="the record's prompts (its eval's --eval-dataset)")
    ap.add_argument("--new-tokens", type=int, default=128, help="the eval's --eval-max-new-tokens")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="the target's dtype (default: the device's; the eval ran bfloat16 on a GPU)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    with open(args.record) as f:
        record = json.load(f)
    taus = record.get("per_prompt_tau")
    if not taus:
        raise SystemExit(f"{args.record}: no per_prompt_tau")
    target = load_target(args.target, device=args.device, dtype=parse_dtype(args.dtype) if args.dtype else None)
    prompts, replies = eval_replies(target, args.dataset, len(taus), args.new_tokens)
    rows = prompt_rows(taus, prompts, replies, record.get("block_size") or 8, record.get("per_prompt_tau_replay"))
    for i, r in enumerate(rows):
        replay = f"  replay {r['replay']:5.2f}" if "replay" in r else ""
        print(f"{i:3d}  tau {r['tau']:5.2f}{replay}  prompt {r['prompt']:4d}  copy_prompt {r['copy_prompt']:.2f}  "
              f"copy_reply {r['copy_reply']:.2f}  copy_dist {r['copy_dist']}  lookup {r['lookup']:5.2f}")
    # the record's own count of generated tokens against these replies': unequal, the decodes differ
    figures = {"target": args.target, "record": args.record, "dataset": args.dataset, "dtype": str(target.dtype),
               "device": args.device, "reply_tokens": sum(len(r) for r in replies),
               "record_generated_tokens": record.get("generated_tokens"), **summary(rows), "prompts": rows}
    print(json.dumps({k: v for k, v in figures.items() if k != "prompts"}, indent=1))
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
