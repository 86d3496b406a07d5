"""Tokens the target's feature forward computes per pack: a padded batch against the packed row.

    python3 benchmarks/pack_padding.py --json benchmarks/results/pack-padding-gemma3-recipe.json
    python3 benchmarks/pack_padding.py --target random:tiny --limit 200 --token-budget 2048   # a check of the script

Counted on the CPU, not timed. The sequences are configs/gemma3-h200.toml's: ShareGPT's train
split whose first prompt fits --max-prompt-tokens, up to --max-turns replies of at most
--max-new-tokens each, --samples reply chains per conversation, cut at --max-length. Reply lengths
stand in by the original replies' token counts, capped (benchmarks/regen_widths.py's stand-in: the
regenerated data itself lives on the GPU machine). The training loader (data/packing.py
PackedLoader) packs them into --token-budget packs for one epoch; per pack a padded batch computes
n_seq x longest tokens, the packed row its real tokens, plus FlexAttention's pad to a multiple of
128 (models/document_attention.py FLEX_TILE).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from regen_widths import selected_turns  # noqa: E402

from dflash_train.data.packing import PackedLoader  # noqa: E402
from dflash_train.models.document_attention import FLEX_TILE  # noqa: E402


def chain_lengths(prompts: list[list[int]], replies: list[list[int]], turns: int, max_length: int) -> np.ndarray:
    """Each conversation's regenerated sequence: its prompt segments and replies up to the last turn run
    (a later turn runs only while its prompt fits --max-length, as regeneration's), plus BOS, cut at max_length."""
    out = []
    for p, r in zip(prompts, replies, strict=True):
        history = 1
        for k in range(min(turns, len(p), len(r))):
            if k and history + p[k] >= max_length:
                break
            history += p[k] + r[k]
        out.append(min(history, max_length))
    return np.asarray(out, dtype=np.int64)


class _Lengths:
    """What PackedLoader reads of a dataset: lengths, and rows of those lengths."""

    def __init__(self, lengths: np.ndarray) -> None:
        self._lengths = lengths

    def lengths(self) -> np.ndarray:
        return self._lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int):
        n = int(self._lengths[i])
        return np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64)


def count(lengths: np.ndarray, budget: int, seed: int) -> dict:
    """One epoch of the training loader's packs: real, padded-batch and flex-row tokens, summed."""
    loader = PackedLoader(_Lengths(lengths), budget, seed)
    packs = real = padded = flex = seqs = 0
    while loader.state.epoch == 0 and loader.state.index < len(lengths):
        _, picked = loader.next()
        n = np.minimum(lengths[picked], budget)
        packs, seqs = packs + 1, seqs + len(n)
        real += int(n.sum())
        padded += len(n) * int(n.max())
        flex += -(-int(n.sum()) // FLEX_TILE) * FLEX_TILE
    return {"packs": packs, "sequences_per_pack": round(seqs / packs, 2), "real_tokens": real,
            "padded_batch_tokens": padded, "packed_row_tokens": flex,
            "padded_over_packed": round(padded / flex, 3), "padding_share_of_padded": round(1 - real / padded, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="gemma3-270m", help="whose tokenizer counts the tokens")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--samples", type=int, default=2, help="reply chains per conversation (--regen-samples)")
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="the first N conversations selected (default 0: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    convs, prompts, replies = selected_turns(args)
    lengths = np.repeat(chain_lengths(prompts, replies, args.max_turns, args.max_length), args.samples)
    out = {"target": args.target, "conversations": len(convs), "sequences": len(lengths),
           "mean_length": round(float(lengths.mean()), 1), "median_length": float(np.median(lengths)),
           "at_max_length": round(float((lengths == args.max_length).mean()), 3),
           "token_budget": args.token_budget, "date": date.today().isoformat(),
           "note": "counted on the CPU, not timed: one epoch of the training loader's packs; reply lengths from the "
                   "original ShareGPT replies, capped at --max-new-tokens",
           "command": "python3 benchmarks/pack_padding.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           **count(lengths, args.token_budget, args.seed)}
    print(f"{out['sequences']} sequences (mean {out['mean_length']}, median {out['median_length']:.0f} tokens), "
          f"{out['packs']} packs of {out['sequences_per_pack']} sequences: padded batches "
          f"{out['padded_batch_tokens'] / 1e6:.1f}M tokens, packed rows {out['packed_row_tokens'] / 1e6:.1f}M "
          f"({out['padded_over_packed']}x; {out['padding_share_of_padded']:.0%} of the padded batches is padding)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
