"""A drafter's accepted drafts by how far back the token after each anchor copies from, on two texts:
the target's greedy replies to eval prompts (what the eval decodes) and the first replies of --limit
regenerated training conversations spread evenly over the file (what the drafter learned from; the file
holds them shortest prompt first).

Every reply token whose block fits inside the reply is a block's known token once; its drafts count up to
the first wrong one, through the training path (training/replay.accepted_runs: the target's features of
the whole sequence, the objective's blocks and dense masks, the drafter's training forward), checked
against the target's greedy tokens as training labels them (--labels target: while the text agrees with
the target; a sampled reply's departures end a run). Anchors are binned by where the token after them
copies from: the latest earlier occurrence of the 4 tokens before it, if that occurrence was followed by
the same token (reply_loops.copy_back, prompt lookup's rule; tau_by_prompt's copy distance takes the
latest occurrence followed by the same token, so its bins are not these), none, or < 32, 32-63, 64-127,
>= 128 tokens back. Low acceptance from far back on both texts says the drafter never learned long-range
copies; low on the eval's replies only, that it meets a pattern there its training data lacks (greedy
replies repeating long prompts).

    python3 benchmarks/accept_by_copy.py --target gemma3-270m --drafter RUN/drafter \
        --regenerated RUN/regenerated-KEY.jsonl [--dataset humaneval] [--limit 40] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

# Run from a checkout without installing: the working tree's sources come first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the siblings reply_loops.py, train_serve_gap.py

from record_json import write_json  # noqa: E402
from reply_loops import copy_back, eval_replies  # noqa: E402
from train_serve_gap import drafter_for  # noqa: E402

from dflash_train.data.conversations import BadRecord  # noqa: E402
from dflash_train.data.tokenize import tokenize_conversation  # noqa: E402
from dflash_train.models.checkpoint import parse_dtype  # noqa: E402
from dflash_train.models.loading import load_target  # noqa: E402
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig  # noqa: E402
from dflash_train.training.replay import accepted_runs  # noqa: E402

NGRAM = 4
BINS = (("none", None, None), ("< 32", 0, 32), ("32-63", 32, 64), ("64-127", 64, 128), (">= 128", 128, None))


def bin_of(back: int | None) -> str:
    for name, lo, hi in BINS:
        if (back is None) == (lo is None) and (lo is None or (back >= lo and (hi is None or back < hi))):
            return name
    raise AssertionError(back)


def by_copy(pairs: list[tuple[list[int], list[int]]], runs: list[list[int]], block_size: int) -> dict:
    """Per bin: anchors, their mean accepted drafts and the share whose first draft is accepted. An anchor
    is each reply token whose block's drafts all fall inside the reply (past its end no draft can count)."""
    accepted: dict[str, list[int]] = {name: [] for name, _, _ in BINS}
    for (prompt, reply), row in zip(pairs, runs, strict=True):
        first = max(NGRAM, len(prompt))  # copy_back's first position
        backs = copy_back(prompt + reply, NGRAM, len(prompt))
        for j in range(len(reply) - block_size + 1):
            pos = len(prompt) + j + 1  # the token after anchor j
            accepted[bin_of(backs[pos - first] if pos >= first else None)].append(row[j])
    return {name: {"anchors": len(a), "accepted": round(sum(a) / len(a), 3) if a else None,
                   "first_draft": round(sum(x > 0 for x in a) / len(a), 3) if a else None,
                   "of_drafts": block_size - 1}
            for name, a in accepted.items()}


def first_replies(target, path: str, limit: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, reply) token ids of the first assistant turn of `limit` records spread evenly over the file,
    tokenized as training tokenizes the conversation (the reply: its loss-masked tokens, the end of turn
    included). Spread, not the first ones: regeneration writes conversations by prompt length, shortest first."""
    pairs = []
    with open(path) as f:
        lines = f.readlines()
    for line in (lines[i * len(lines) // limit] for i in range(min(limit, len(lines)))):
        messages = json.loads(line)["messages"]
        turn = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if turn is None:
            continue
        try:
            ids, mask = tokenize_conversation(target.tokenizer, messages[:turn + 1], 1 << 16)
        except BadRecord:  # training skips it too
            continue
        start = list(mask).index(1)
        end = next((i for i in range(start, len(mask)) if not mask[i]), len(mask))
        pairs.append((list(ids[:start]), list(ids[start:end])))
    return pairs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="the target's dtype (default: the device's)")
    ap.add_argument("--drafter", help="a drafter directory (default: a fresh one from the target's layers)")
    ap.add_argument("--num-layers", type=int, default=2, help="the fresh drafter's layers")
    ap.add_argument("--block-size", type=int, default=8, help="the fresh drafter's block size")
    ap.add_argument("--regenerated", help="a run's regenerated-*.jsonl: the training text")
    ap.add_argument("--dataset", default="humaneval", help="the eval text's prompts")
    ap.add_argument("--limit", type=int, default=40, help="prompts, and records, of each text")
    ap.add_argument("--new-tokens", type=int, default=128, help="the eval's --eval-max-new-tokens")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.limit < 1:
        ap.error(f"--limit must be >= 1, got {args.limit}")

    target = load_target(args.target, device=args.device, dtype=parse_dtype(args.dtype) if args.dtype else None)
    drafter = drafter_for(target, args.drafter, args.num_layers, args.block_size)
    B = drafter.block_size
    obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head, ObjectiveConfig(attention="dense"),
                          embed_scale=target.embed_scale)
    texts = {f"{args.dataset} greedy": list(zip(*eval_replies(target, args.dataset, args.limit, args.new_tokens),
                                                strict=True))}
    if args.regenerated:
        texts["regenerated"] = first_replies(target, args.regenerated, args.limit)
    figures = {"target": args.target, "drafter": args.drafter or f"fresh, {args.num_layers} layers",
               "device": args.device, "dtype": str(target.dtype), "date": datetime.date.today().isoformat()}
    for name, pairs in texts.items():
        # every anchor a full block: the replay's cut blocks near a token limit are the eval's, not the drafter's
        runs = [accepted_runs(target, obj, p, r, len(r) + B, target_labels=True) for p, r in pairs]
        figures[name] = table = by_copy(pairs, runs, B)
        print(f"{name}: {len(pairs)} replies")
        for bin_name, row in table.items():
            print(f"  copies from {bin_name:>7}: {row['anchors']:6d} anchors, accepted {row['accepted']}, "
                  f"first draft {row['first_draft']}")
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
