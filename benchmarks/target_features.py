"""The target feature forward on variable-length packs: the padded batch against the packed row.

    python3 benchmarks/target_features.py --data .gpu/prep-sharegpt --steps 20
    python3 benchmarks/target_features.py --data .gpu/prep-sharegpt --steps 20 --compile-target
    python3 benchmarks/target_features.py --steps 20          # random lengths, no data needed

Packs are made as training makes them (data/packing.py PackedLoader, --token-budget tokens)
from a prepared dataset (`dflash-train prepare ... --out DIR`), or without --data from random
sequence lengths (log-normal, median --median-length, capped at --max-length; a stand-in for
chat data with regenerated replies). Each path first runs --warmup packs (compilation,
allocator; excluded), then --steps other packs, each between two CUDA events; one host sync
at the end of the timed window. Paths (pipeline/features.py packed_features):

    padded   the right-padded [n_seq, longest] batch (the path before the packed row)
    auto     what training runs: the packed row with a document mask (FlexAttention on CUDA),
             the padded batch where it pads nothing (one sequence, equal lengths)
    flex     the packed row always; dense: its CPU form (a dense mask)

Reported per path: median ms per pack, tokens/s (real tokens over the summed pack times, and
over the wall clock of the timed window), the share of computed tokens that are padding, peak
memory, and the largest relative difference of its features from the padded path's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Run from a checkout without installing: the working tree's sources come first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflash_train.data.packing import PackedLoader  # noqa: E402
from dflash_train.devices import resolve_device  # noqa: E402
from dflash_train.models.config import default_target_layer_ids  # noqa: E402
from dflash_train.models.document_attention import FLEX_TILE  # noqa: E402
from dflash_train.models.loading import load_target  # noqa: E402
from dflash_train.pipeline.features import feature_mode, packed_features, sequence_lengths  # noqa: E402

PATHS = ("padded", "auto", "flex", "dense")


class RandomLengths:
    """A stand-in for a prepared dataset: random token ids of log-normal lengths."""

    def __init__(self, n: int, median: int, max_length: int, vocab: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self._lengths = np.clip(rng.lognormal(np.log(median), 0.9, n), 8, max_length).astype(np.int64)
        self._rng, self._vocab = rng, vocab

    def lengths(self) -> np.ndarray:
        return self._lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int):
        n = int(self._lengths[i])
        return self._rng.integers(0, self._vocab, n), np.ones(n, dtype=np.int64)


def make_packs(args, vocab: int, count: int) -> tuple[list, str]:
    if args.data:
        from dflash_train.data.dataset import PreparedDataset

        dataset, what = PreparedDataset.open(args.data), f"prepared data {args.data}"
    else:
        dataset = RandomLengths(4096, args.median_length, args.max_length, min(vocab, 32000), args.seed)
        what = f"random lengths (log-normal, median {args.median_length}, max {args.max_length})"
    lengths = np.asarray(dataset.lengths())
    what += f": {len(lengths)} sequences, mean length {lengths.mean():.0f}, median {np.median(lengths):.0f}"
    loader = PackedLoader(dataset, args.token_budget, args.seed)
    return [loader.next()[0] for _ in range(count)], what


def padding_share(batch, path: str, device: torch.device) -> float:
    """Share of the tokens the target computes that are padding, on this path."""
    lengths = sequence_lengths(batch)
    real = int(lengths.sum())
    mode = feature_mode(lengths, device) if path == "auto" else path
    computed = {"padded": len(lengths) * int(lengths.max()), "flex": -(-real // FLEX_TILE) * FLEX_TILE}.get(mode, real)
    return 1 - real / computed


class Timer:
    """CUDA events around each pack (no sync until the end); the wall clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.spans.append((start, ev))
        else:
            self.spans.append((start, time.perf_counter()))

    def ms(self) -> list[float]:
        if self.cuda:
            return [s.elapsed_time(e) for s, e in self.spans]  # after the final synchronize
        return [(e - s) * 1e3 for s, e in self.spans]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: the timed window's ends only


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_path(target, packs: list, layer_ids: list[int], path: str, warmup: int, device: torch.device) -> dict:
    for batch in packs[:warmup]:
        packed_features(target, batch, layer_ids, mode=path)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed, timer, graphs = packs[warmup:], Timer(device), graphs_compiled()
    t0 = time.perf_counter()
    for batch in timed:
        start = timer.start()
        packed_features(target, batch, layer_ids, mode=path)
        timer.stop(start)
    sync(device)
    wall = time.perf_counter() - t0
    ms = timer.ms()
    tokens = sum(b.num_tokens for b in timed)
    return {
        "path": path,
        "ms_per_pack_median": statistics.median(ms),
        "tokens_per_s": tokens / (sum(ms) / 1e3),
        "wall_tokens_per_s": tokens / wall,
        "padding_share": float(np.mean([padding_share(b, path, device) for b in timed])),
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "recompiled_while_timed": graphs_compiled() - graphs,
        "rel_diff_vs_padded": relative_diff(target, timed[0], layer_ids, path),
    }


def relative_diff(target, batch, layer_ids: list[int], path: str) -> float:
    """||features - padded features|| / ||padded features|| on one pack (outside the timed window)."""
    want = packed_features(target, batch, layer_ids, mode="padded").float()
    got = packed_features(target, batch, layer_ids, mode=path).float()
    return float((got - want).norm() / want.norm())  # host sync (after timing)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="random:smollm2-135m", help="as for dflash-train (default random:smollm2-135m)")
    p.add_argument("--data", help="a prepared dataset directory (dflash-train prepare); default: random lengths")
    p.add_argument("--token-budget", type=int, default=16384, help="context tokens per pack (default 16384)")
    p.add_argument("--steps", type=int, default=20, help="timed packs per path (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed packs per path first (default 5)")
    p.add_argument("--paths", default="padded,auto",
                   help=f"comma-separated, from {','.join(PATHS)} (default padded,auto)")
    p.add_argument("--compile-target", action="store_true",
                   help="the target's layers under torch.compile, as in training")
    p.add_argument("--num-features", type=int, default=5,
                   help="target layers captured (default 5, spread as for a drafter)")
    p.add_argument("--max-length", type=int, default=2048, help="random lengths: longest sequence (default 2048)")
    p.add_argument("--median-length", type=int, default=600, help="random lengths: median (default 600)")
    p.add_argument("--device", default="auto", help="cuda (default when present) or cpu (a smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    bad = [x for x in args.paths.split(",") if x not in PATHS]
    if bad:
        p.error(f"--paths: unknown {bad} (choose from {', '.join(PATHS)})")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    target = load_target(args.target, device=device, seed=args.seed)
    layer_ids = default_target_layer_ids(target.num_layers, args.num_features)
    packs, what = make_packs(args, target.vocab_size, args.warmup + args.steps)
    seqs = [int(sequence_lengths(b).numel()) for b in packs]
    print(f"target {args.target} ({target.num_layers} layers, {target.dtype}) on {device}, features of layers "
          f"{layer_ids}; {what}")
    print(f"packs: {args.token_budget}-token budget, {np.mean([b.num_tokens for b in packs]):.0f} tokens and "
          f"{np.mean(seqs):.1f} sequences on average; compile-target {args.compile_target}")
    results = []
    with target.compiled_layers(args.compile_target):
        for path in args.paths.split(","):
            r = run_path(target, packs, layer_ids, path, args.warmup, device)
            results.append(r)
            recompiled = r["recompiled_while_timed"]
            print(f"{path:>7}: {r['ms_per_pack_median']:8.2f} ms/pack (median of {args.steps}), "
                  f"{r['tokens_per_s']:>12,.0f} tokens/s ({r['wall_tokens_per_s']:,.0f} by wall clock), "
                  f"padding {r['padding_share']:.1%}"
                  + (f", WARNING: {recompiled} graphs compiled while timed (more --warmup)" if recompiled else ""))
    print_table(results)
    record = {"target": args.target, "data": args.data or what, "token_budget": args.token_budget,
              "steps": args.steps, "compile_target": args.compile_target, "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return record


def print_table(results: list[dict]) -> None:
    base = next((r for r in results if r["path"] == "padded"), None)
    print()
    print(f"{'path':<8} {'ms/pack':>9} {'tokens/s':>12} {'wall tok/s':>12} {'padding':>8} {'peak GB':>8} "
          f"{'vs padded':>9} {'rel diff':>9}")
    for r in results:
        mem = f"{r['peak_memory_gb']:.2f}" if r["peak_memory_gb"] is not None else "-"
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        diff = f"{r['rel_diff_vs_padded']:.1e}"
        print(f"{r['path']:<8} {r['ms_per_pack_median']:>9.2f} {r['tokens_per_s']:>12,.0f} "
              f"{r['wall_tokens_per_s']:>12,.0f} {r['padding_share']:>8.1%} {mem:>8} {speed:>9} {diff:>9}")


if __name__ == "__main__":
    main()
