"""The target features a drafter's fusion (fc) reads, column by column: whether a few huge columns drown the rest.

    python3 benchmarks/feature_columns.py --target gemma3-270m --dataset sharegpt --limit 24     # CPU, ~1 min
    python3 benchmarks/feature_columns.py --target smollm2-135m --dataset sharegpt --limit 24    # the Llama control
    python3 benchmarks/feature_columns.py --target random:tiny --limit 2 --new-tokens 16          # the CPU plumbing

The text: the eval set's first --limit prompts and the target's greedy replies, every sequence's first token
left out (Gemma's <bos> runs ~100x the rest). Per feature layer (the default drafter's): the layer's RMS, the
median column's RMS and the largest columns', the mean cosine between two tokens' feature vectors (near 1: the
huge columns make every token look alike), and the layer's share of the energy of a fresh fc's output (random
normal weights, as a new drafter starts) on the raw features (--feature-scale none) and on unit-RMS columns
(--feature-scale rms, training/drafter_loop.feature_rms_scale). AdamW moves every weight about lr a step, so
where a layer's share is tiny its columns need weights far larger than the start's, grown at that pace.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the siblings reply_loops.py, train_serve_gap.py

from record_json import write_json  # noqa: E402
from reply_loops import add_reply_args, eval_replies  # noqa: E402
from train_serve_gap import packed_replies  # noqa: E402

from dflash_train.models.factory import drafter_config_for  # noqa: E402
from dflash_train.models.loading import load_target  # noqa: E402
from dflash_train.pipeline.features import target_features  # noqa: E402
from dflash_train.pipeline.target_features import FeatureSpec  # noqa: E402
from dflash_train.training.drafter_loop import feature_column_rms, feature_rms_scale  # noqa: E402


def mean_cosine(x: torch.Tensor, n: int = 512) -> float:
    """Mean cosine between two distinct tokens' vectors (up to n tokens, evenly spread)."""
    x = torch.nn.functional.normalize(x[torch.linspace(0, len(x) - 1, min(n, len(x))).long()], dim=-1)
    c = x @ x.T
    return ((c.sum() - c.diagonal().sum()) / (len(x) * (len(x) - 1))).item()


def layer_shares(x: torch.Tensor, layers: int, seed: int = 0) -> list[float]:
    """Each layer's share of the energy of fc(x) for a fresh fc (normal weights; the share does not depend on
    their spread)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(x.shape[1], x.shape[1] // layers, generator=g)
    parts = [xi @ wi for xi, wi in zip(x.chunk(layers, 1), w.chunk(layers, 0), strict=True)]
    energy = torch.stack([p.square().sum() for p in parts])
    return (energy / energy.sum()).tolist()


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_reply_args(ap, limit=24, new_tokens=128)
    ap.add_argument("--top", type=int, default=3, help="the largest columns listed per layer")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    target = load_target(args.target, device=args.device)
    prompts, replies = eval_replies(target, args.dataset, args.limit, args.new_tokens)
    _, batch = packed_replies(prompts, replies, target.device)
    layers = tuple(drafter_config_for(target, num_layers=1, block_size=2).target_layer_ids)
    hidden = target_features(target, batch, FeatureSpec(layers=layers)).hidden
    column_rms = feature_column_rms(hidden, batch.positions).cpu()
    scale = feature_rms_scale(hidden, batch.positions).cpu()
    x = hidden[batch.positions > 0].float().cpu()
    H = target.hidden_size
    raw, scaled = layer_shares(x, len(layers)), layer_shares(x * scale, len(layers))
    figures = {"target": args.target, "device": args.device, "dtype": str(target.dtype), "tokens": len(x),
               "date": datetime.date.today().isoformat(), "layers": {}}
    print(f"{args.target}: {len(x)} tokens ({args.dataset}, {args.limit} prompts + greedy replies), feature layers "
          f"{list(layers)}")
    print(f"{'layer':>5} {'RMS':>8} {'median col':>10} {'largest columns (index: RMS)':<44} {'cos':>5} "
          f"{'share raw':>9} {'share rms':>9}")
    for i, layer in enumerate(layers):
        cols = x[:, i * H:(i + 1) * H]
        col_rms = column_rms[i * H:(i + 1) * H]
        top = col_rms.topk(min(args.top, H))
        row = {"rms": cols.square().mean().sqrt().item(), "median_column_rms": col_rms.median().item(),
               "largest_columns": dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)),
               "mean_cosine": mean_cosine(cols), "share_raw": raw[i], "share_rms": scaled[i]}
        figures["layers"][str(layer)] = row
        big = ", ".join(f"{j}: {_num(v)}" for j, v in row["largest_columns"].items())
        print(f"{layer:>5} {_num(row['rms']):>8} {_num(row['median_column_rms']):>10} {big:<44} "
              f"{row['mean_cosine']:>5.2f} {row['share_raw']:>9.4f} {row['share_rms']:>9.4f}")
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
