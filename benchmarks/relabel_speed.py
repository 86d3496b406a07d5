"""Target labels (--labels target) on one prepared dataset: padded batches against packed rows.

    python3 benchmarks/relabel_speed.py --data PREPARED_DIR [--target smollm2-135m --device cuda --json OUT.json]

The relabel phase is one teacher-forced target forward over every token of the training data. It
ran as right-padded batches of 4,096 tokens, one LM head and host copy per sequence: on the
shipped H200 recipe with two sampled replies per prompt (15.2M tokens) it took 187 s, 81K tokens/s,
a fifth of that run's 15-minute budget. Packed rows (the training forward's document mask, 16,384
real tokens a row, one host copy per row) are the default on CUDA now. On a CPU the packed rows
use a dense mask of at most 4,096 tokens: the figures there say little. This relabels copies of the
dataset both ways, timed alone, and prints tokens/s and how many labels the two agree on (bf16:
a near-tie may flip between two attention kernels; in float32 on CPU they are equal, see
tests/test_relabel.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from dflash_train.data.dataset import LABELS, PreparedDataset
from dflash_train.data.relabel import PACKED_TOKENS, PADDED_TOKENS, relabel
from dflash_train.models.loading import load_target

VARIANTS = {f"padded-{PADDED_TOKENS}": ("padded", PADDED_TOKENS), f"packed-{PACKED_TOKENS}": ("packed", PACKED_TOKENS)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a prepared dataset directory (dflash-train prepare --out)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    target = load_target(args.target, device=args.device)
    tokens = int(PreparedDataset.open(args.data).lengths().sum())
    out: dict = {"device": torch.cuda.get_device_name(0) if target.device.type == "cuda" else "cpu",
                 "date": date.today().isoformat(), "tokens": tokens,
                 "command": "python3 benchmarks/relabel_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    labels = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (mode, batch) in VARIANTS.items():
            copy = Path(tmp) / name
            shutil.copytree(args.data, copy, ignore=shutil.ignore_patterns(LABELS))
            times = []
            for _ in range(2):  # the first run compiles (FlexAttention): a job pays it once, as here
                (copy / LABELS).unlink(missing_ok=True)
                t0 = time.perf_counter()
                rep = relabel(target, copy, batch_tokens=batch, mode=mode, progress=False)
                times.append(time.perf_counter() - t0)  # relabel ends on a host copy: nothing left queued
            labels[name] = np.load(copy / LABELS)
            out[name] = {"seconds_first": round(times[0], 2), "seconds": round(times[1], 2),
                         "tokens_per_s": round(tokens / times[1])}
            print(f"{name:>14}: {tokens} tokens in {times[1]:.1f} s = {tokens / times[1]:,.0f} tokens/s "
                  f"(first run {times[0]:.1f} s; {rep.agree / max(rep.labelled, 1):.0%} of labels already the text's)")
    a, b = labels.values()
    out["labels_equal_share"] = float((a == b).mean())
    print(f"labels equal in the two ways: {out['labels_equal_share']:.5%} of positions")
    if args.json:
        Path(args.json).write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
