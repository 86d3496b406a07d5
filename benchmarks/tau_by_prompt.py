"""Where an eval's tau comes from, prompt by prompt: its length, and how far back its reply copies from.

Reads an eval record (RUN/eval_after.json, or `dflash-train eval --json`), decodes the same prompts
greedily with the target (the tokens the eval's decode emitted, up to ties) and gives, for each prompt,
the drafter's tau beside:
  prompt     the rendered prompt's tokens;
  copy_far   the share of reply tokens whose 4-gram continuation last occurred >= --far tokens back
             (a copy of the prompt, or of a distant part of the reply; prompt lookup gets these right);
  copy_near  the share whose continuation occurred fewer than --far tokens back (a short loop);
  lookup     prompt lookup's tau on that reply (eval/lookup.py).
Then the mean tau by prompt length (thirds) and the correlation of tau with each column. A drafter
that copies only what is near (tau falling with copy_far and prompt length while lookup stays high)
never learned long-range copying, or the decode path differs from training on long contexts
(eval's tau_replay tells which).

    python3 benchmarks/tau_by_prompt.py --target gemma3-270m --record RUN/eval_after.json --dataset humaneval
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dflash_train.decode import static_lm
from dflash_train.decode.generate import generate
from dflash_train.eval.lookup import lookup_tau
from dflash_train.eval.prompts import load_prompts
from dflash_train.models.chat import render_chat, stop_token_ids
from dflash_train.models.loading import load_target


def copy_distances(seq: list[int], start: int, n: int = 4) -> list[int | None]:
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


def prompt_rows(taus: list[float], prompts: list[list[int]], replies: list[list[int]], far: int,
                block_size: int) -> list[dict]:
    rows = []
    for tau, prompt, reply in zip(taus, prompts, replies, strict=True):
        dists = copy_distances(prompt + reply, len(prompt))
        n = max(len(dists), 1)
        rows.append({"tau": round(tau, 3), "prompt": len(prompt),
                     "copy_far": round(sum(d is not None and d >= far for d in dists) / n, 3),
                     "copy_near": round(sum(d is not None and d < far for d in dists) / n, 3),
                     "lookup": round(lookup_tau([prompt], [reply], block_size), 3)})
    return rows


def summary(rows: list[dict]) -> dict:
    """Mean tau by prompt-length third, and tau's correlation with each column."""
    by_len = sorted(rows, key=lambda r: r["prompt"])
    k = len(by_len) // 3 or 1
    thirds = [by_len[:k], by_len[k:len(by_len) - k], by_len[len(by_len) - k:]]
    out = {"tau_by_prompt_third": [{"prompt": [t[0]["prompt"], t[-1]["prompt"]],
                                    "tau": round(statistics.mean(r["tau"] for r in t), 3),
                                    "lookup": round(statistics.mean(r["lookup"] for r in t), 3)}
                                   for t in thirds if t]}
    taus = [r["tau"] for r in rows]
    for col in ("prompt", "copy_far", "copy_near", "lookup"):
        xs = [r[col] for r in rows]
        ok = len(rows) > 2 and len(set(xs)) > 1 and len(set(taus)) > 1
        out[f"corr_tau_{col}"] = round(statistics.correlation(xs, taus), 3) if ok else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--record", required=True, help="an eval record with per_prompt_tau (RUN/eval_after.json)")
    ap.add_argument("--dataset", default="humaneval", help="the record's prompts (its eval's --eval-dataset)")
    ap.add_argument("--new-tokens", type=int, default=128, help="the eval's --eval-max-new-tokens")
    ap.add_argument("--far", type=int, default=128, help="copy distance that counts as far, in tokens")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    with open(args.record) as f:
        record = json.load(f)
    taus = record.get("per_prompt_tau")
    if not taus:
        raise SystemExit(f"{args.record}: no per_prompt_tau")
    target = load_target(args.target, device=args.device)
    lm = static_lm.for_model(target.model)
    if lm is None:
        raise SystemExit(f"{args.target}: no StaticLM for this architecture")
    prompts = [render_chat(target, m) for m in load_prompts(args.dataset, len(taus))]
    stops = sorted(set(stop_token_ids(target)))
    replies = [r[:next((i + 1 for i, t in enumerate(r) if t in stops), None)]
               for r in generate(lm, prompts, args.new_tokens, stops).rows]
    rows = prompt_rows(taus, prompts, replies, args.far, record.get("block_size") or 8)
    for i, r in enumerate(rows):
        print(f"{i:3d}  tau {r['tau']:5.2f}  prompt {r['prompt']:4d}  copy_far {r['copy_far']:.2f}  "
              f"copy_near {r['copy_near']:.2f}  lookup {r['lookup']:5.2f}")
    figures = {"target": args.target, "record": args.record, "dataset": args.dataset, "far": args.far,
               **summary(rows), "prompts": rows}
    print(json.dumps({k: v for k, v in figures.items() if k != "prompts"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
