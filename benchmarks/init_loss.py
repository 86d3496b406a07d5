"""A fresh drafter's first loss and logit scale under each start: how far from the target's own
predictions a drafter begins training.

    python3 benchmarks/init_loss.py --target gemma3-270m --dataset sharegpt --limit 6      # CPU, ~2 min
    python3 benchmarks/init_loss.py --target smollm2-135m --dataset sharegpt --limit 6     # the Llama control
    python3 benchmarks/init_loss.py --target random:tiny --num-layers 2 --block-size 4 --intermediate-size 128 \\
        --limit 2 --new-tokens 16                                                          # the CPU plumbing

Starts: `from-target` (models/factory.init_from_target, train's default), `fresh` (--no-init-from-target)
and `from-target+final-norm` (init_from_target and the target's final norm as well, which it leaves out
for Gemma targets). The text: the eval set's first --limit prompts and the target's greedy replies. Blocks are
anchored every B-1 tokens of each reply; each slot's logits go through the training path (the objective's
blocks, dense masks) and are scored against the target's greedy labels, as `--labels target` trains:
cross-entropy (the first logged loss a run would see, all slots weighted alike), the largest |logit|, and
slot 1's accuracy. A start whose loss sits far above ln(vocabulary) spends its first steps undoing itself.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the siblings reply_loops.py, train_serve_gap.py

from record_json import write_json  # noqa: E402
from reply_loops import add_reply_args, eval_replies  # noqa: E402
from train_serve_gap import drafter_for, packed_replies, training_drafts  # noqa: E402

from dflash_train.models.chat import is_gemma  # noqa: E402
from dflash_train.models.factory import drafter_config_for  # noqa: E402
from dflash_train.models.loading import load_target  # noqa: E402
from dflash_train.pipeline.features import target_features  # noqa: E402
from dflash_train.pipeline.target_features import FeatureSpec  # noqa: E402

STARTS = ("from-target", "fresh", "from-target+final-norm")


def drafter(target, start: str, args):
    d = drafter_for(target, None, args.num_layers, args.block_size, intermediate_size=args.intermediate_size,
                    init=start != "fresh")
    if start == "from-target+final-norm":
        with torch.no_grad():
            d.norm.weight.copy_(target.decoder.norm.weight + (1.0 if is_gemma(target) else 0.0))
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_reply_args(ap, limit=6, new_tokens=64)
    ap.add_argument("--num-layers", type=int, default=12, help="the recipes' depth")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--intermediate-size", type=int, help="the draft MLP's width (default: 2x the target's)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    target = load_target(args.target, device=args.device)
    args.intermediate_size = args.intermediate_size or 2 * target.config.intermediate_size
    prompts, replies = eval_replies(target, args.dataset, args.limit, args.new_tokens)
    seqs, batch = packed_replies(prompts, replies, target.device)
    B = args.block_size
    layers = tuple(drafter_config_for(target, num_layers=args.num_layers, block_size=B).target_layer_ids)
    feats = target_features(target, batch, FeatureSpec(layers=layers, labels=True))
    offsets = torch.cumsum(torch.tensor([0] + [len(s) for s in seqs]), 0).tolist()
    anchors = [o + a for o, p, s in zip(offsets, prompts, seqs, strict=False)
               for a in range(len(p), len(s) - B + 1, B - 1)]
    labels = feats.labels.long()
    want = torch.stack([labels[a + torch.arange(B - 1, device=labels.device)] for a in anchors])  # slot k: a+k-1
    figures = {"target": args.target, "device": args.device, "dtype": str(target.dtype), "anchors": len(anchors),
               "ln_vocab": round(math.log(target.vocab_size), 2), "date": datetime.date.today().isoformat()}
    print(f"{args.target}: {len(anchors)} blocks of {B}, ln(vocabulary) {figures['ln_vocab']}")
    for start in STARTS:
        logits = training_drafts(target, drafter(target, start, args), batch, feats.hidden,
                                 torch.tensor(anchors, device=target.device), attention="dense")
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), want.flatten()).item()
        figures[start] = row = {"loss": round(loss, 2), "max_abs_logit": round(logits.abs().max().item(), 1),
                                "slot1_acc": round((logits[:, 0].argmax(-1) == want[:, 0]).float().mean().item(), 3)}
        print(f"  {start:22s} loss {row['loss']:8.2f}  max |logit| {row['max_abs_logit']:8.1f}  "
              f"slot-1 accuracy {row['slot1_acc']:.3f}")
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
