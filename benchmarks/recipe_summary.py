"""Summarise a recipe sweep (benchmarks/recipe_sweep.sh): a table, OUT_DIR/summary.json and a learning-curve PNG.

    python3 benchmarks/recipe_summary.py OUT_DIR [--png docs/quality-curve.png] [--with EARLIER_SWEEP ...]

Per variant (a sub-directory with train.status): its train flags, steps, training seconds, the
target tokens it trained on, its last logged train estimate of tau, and tau / speedup / per-slot
acceptance of each eval-*.json beside it. The curve plots each variant's train tau estimate
against target tokens trained on, with its HumanEval tau at the end as a marker; --with adds the
variants of earlier sweeps (their summary.json) to the picture, so one PNG shows every recipe tried.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from pathlib import Path

TRAINED = re.compile(r"trained (\d+) steps in (\d+) s")  # "(run N s)" followed it in older logs
DATASETS = ("humaneval", "mtbench", "sharegpt")


PREPARED = re.compile(r"prepare: \d+ sequences, (\d+) tokens")


def data_tokens(d: Path, cfg: dict) -> int | None:
    """Tokens of the prepared data a variant trained on: its meta.json, else the `prepare:` line of
    the train.log of the variant that prepared it (the data may live on another machine)."""
    data = Path(cfg.get("data", ""))
    for meta in [data / "meta.json", *sorted(d.glob("data-*/meta.json"))]:
        if meta.is_file():
            return json.loads(meta.read_text())["tokens"]
    for log in (d / "train.log", d.parent / data.parent.name / "train.log"):
        m = PREPARED.search(log.read_text()) if log.is_file() else None
        if m:
            return int(m.group(1))
    return None


def trained_tokens(records: list[dict]) -> list[float]:
    """Target tokens trained on up to each metrics record: its interval's tokens/s times the interval's
    seconds, summed (exact to 0.03% on 2026-12-01e's L12B8); [] for records without both fields."""
    if not records or not all("target_tokens_per_s" in r and "elapsed_s" in r for r in records):
        return []
    total, out = 0.0, []
    for r in records:
        total += r["target_tokens_per_s"] * r["elapsed_s"]
        out.append(total)
    return out


def label(r: dict) -> str:
    rec = r["recipe"]
    length = f"{rec['max_steps']} steps" if rec.get("max_steps") else f"{rec.get('epochs')} epochs"
    turns = f", {rec['regen_max_turns']} turns" if rec.get("regen_max_turns", 1) != 1 else ""
    mlp = f", MLP {rec['intermediate_size']}" if rec.get("intermediate_size") else ""
    samples = (f", {rec['regen_samples']} replies at T={rec.get('regen_temperature')}"
               if rec.get("regen_samples", 1) > 1 else "")
    labels = ", target labels" if rec.get("labels") == "target" else ""
    scale = ", unit-RMS features" if rec.get("feature_scale") == "rms" else ""
    return (f"{r['name']}: {rec.get('num_layers')} layers{mlp}, B={rec.get('block_size', 16)}, "
            f"{rec.get('num_anchors')} anchors, {length}, lr {rec.get('lr')}{turns}{samples}{labels}{scale}")


def run_config(path: Path) -> dict:
    """A run's config.toml as flat keys: its [run], [data], ... tables merged (files written before
    the sections have flat keys already); {} when there is none."""
    if not path.is_file():
        return {}
    flat: dict = {}
    for key, value in tomllib.loads(path.read_text()).items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def variant_summary(d: Path) -> dict:
    code, wall = (d / "train.status").read_text().split()
    cfg = run_config(d / "config.toml")
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (d / "metrics.jsonl").is_file() else []
    m = TRAINED.search((d / "train.log").read_text()) if (d / "train.log").is_file() else None
    tokens = data_tokens(d, cfg)
    steps = int(m.group(1)) if m else (records[-1]["step"] if records else 0)
    per_step = tokens * cfg.get("epochs", 0) / steps if tokens and steps and not cfg.get("max_steps") else None
    seen = trained_tokens(records)
    out = {
        "name": d.name, "exit_code": int(code), "wall_s": int(wall),
        "recipe": {k: cfg.get(k) for k in ("num_layers", "block_size", "num_anchors", "token_budget", "lr",
                                           "epochs", "max_steps", "gamma", "labels", "sliding_layers",
                                           "regen_max_turns", "intermediate_size", "regen_samples",
                                           "regen_temperature", "feature_scale") if k in cfg},
        "steps": steps, "train_s": int(m.group(2)) if m else None,
        "train_tokens": round(seen[-1]) if seen else round(tokens * cfg.get("epochs", 0)) if tokens else None,
        "train_tau_estimate": records[-1]["expected_tau"] if records else None,
        "train_acc": records[-1]["acc"] if records else None,
        "curve": [(x, r["expected_tau"]) for x, r in zip(seen, records, strict=True)] if seen else
                 [(r["step"] * per_step if per_step else r["step"], r["expected_tau"]) for r in records],
        # the held-out estimate (--val-conversations), at the records that carry one
        "val_curve": [(x, r["val_expected_tau"]) for x, r in zip(seen, records, strict=True)
                      if "val_expected_tau" in r],
    }
    for name in DATASETS:
        f = d / f"eval-{name}.json"
        if f.is_file():
            r = json.loads(f.read_text())
            out[f"tau_{name}"] = r["tau"]
            out[f"speedup_{name}"] = r["speedup"]
            out[f"acceptance_{name}"] = [round(a, 3) for a in r["per_position_acceptance"][:4]]
            if r.get("tau_by_category"):
                out[f"tau_{name}_by_category"] = r["tau_by_category"]
            if name == "mtbench" and len(r.get("per_prompt_tau", [])) > 40:
                out["tau_mtbench_first40"] = first_tau(r, 40)  # what sweeps before 2026-12-02 measured
    quality = d / "quality.json"  # quality_h200.sh's record: its taus stand in for eval files not fetched
    if quality.is_file():
        q = json.loads(quality.read_text())
        out.update({k: q[k] for k in ("tau_humaneval", "tau_mtbench", "tau_sharegpt", "tau_mtbench_first40",
                                      "tau_mtbench_by_category") if k in q and k not in out})
    return out


def first_tau(report: dict, n: int) -> float:
    """tau over an eval report's first n prompts (steps-weighted, as its tau is over all)."""
    tau, steps = report["per_prompt_tau"][:n], report["per_prompt_steps"][:n]
    return sum(t * s for t, s in zip(tau, steps, strict=True)) / max(1, sum(steps))


def table(rows: list[dict]) -> str:
    head = f"{'variant':<10}{'steps':>7}{'train s':>9}{'wall s':>8}{'train tau':>10}" + \
        "".join(f"{'tau ' + n[:6]:>12}" for n in DATASETS) + f"{'speedup he':>12}"
    lines = [head]
    for r in rows:
        taus = "".join(f"{r.get('tau_' + n, float('nan')):>12.3f}" for n in DATASETS)
        lines.append(f"{r['name']:<10}{r['steps']:>7}{r['train_s'] or 0:>9}{r['wall_s']:>8}"
                     f"{r['train_tau_estimate'] or float('nan'):>10.3f}{taus}"
                     f"{r.get('speedup_humaneval') or float('nan'):>12.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5))
    colors = plt.get_cmap("tab20").colors  # the default cycle repeats after 10 lines
    for i, r in enumerate(rows):
        if not r["curve"]:
            continue
        x, y = zip(*r["curve"], strict=True)
        line, = ax.plot([v / 1e6 for v in x], y, label=label(r), color=colors[(2 * i) % 20 + (i // 10) % 2])
        if r.get("val_curve"):
            vx, vy = zip(*r["val_curve"], strict=True)
            ax.plot([v / 1e6 for v in vx], vy, "--", color=line.get_color())
        for name, marker in (("humaneval", "o"), ("mtbench", "s"), ("sharegpt", "x")):
            if f"tau_{name}" in r:
                ax.plot([x[-1] / 1e6], [r[f"tau_{name}"]], marker, color=line.get_color())
    ax.set_xlabel("target tokens trained on (millions)")
    ax.set_ylabel("tau")
    ax.set_title("lines: train estimate (seen data); dashed: held-out conversations (--val-conversations);\n"
                 "o HumanEval, s MT-Bench, x held-out ShareGPT", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: 20 recipes cover the lines
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--png", type=Path, help="learning-curve picture (default OUT/curve.png)")
    ap.add_argument("--with", dest="earlier", type=Path, action="append", default=[], metavar="SWEEP",
                    help="an earlier sweep directory whose summary.json variants join the picture")
    args = ap.parse_args()
    rows = [variant_summary(d) for d in sorted(args.out.iterdir()) if (d / "train.status").is_file()]
    print(table(rows))
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    earlier = [r for d in args.earlier for r in json.loads((d / "summary.json").read_text())]
    plot(earlier + rows, args.png or args.out / "curve.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
