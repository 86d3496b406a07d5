"""Several GPUs of one host: role splits through the real multi-process pipeline, and the link.

    --splits 1+1,x2       on two GPUs; 1+3,2+2,x4 on four
        T+D   T target GPUs and D other drafter GPUs: features cross GPUs over NCCL point-to-point
        xN    N GPUs that each hold a target and a drafter (whole pipelines); only gradients cross

Each split trains the bench's drafter on the bench's synthetic sequences (written as a prepared
dataset) through `Launcher` and the worker processes a `dflash-train train --target-devices ...
--drafter-devices ...` run would start, for 2 x --steps steps with --steps packs per drafter
worker timed (metrics record of the last --steps steps). Profiling is on (wall clock, 1 s
windows) so each split reports the verdicts its processes printed.

The link is measured in the same run: a device-to-device copy between GPU 0 and GPU 1 in one
process, NCCL send/recv of 1 GiB between two processes, and the hand-off itself (P2PSender ->
P2PReceiver) with feature messages of the benchmark's shape.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from dflash_train.app.ranks import launch_workers, worker_roles
from dflash_train.bench.config import Split, train_config
from dflash_train.data.dataset import write_sequences
from dflash_train.pipeline.handoff import P2PReceiver, P2PSender
from dflash_train.pipeline.launcher import free_port
from dflash_train.pipeline.target_features import TargetFeatures
from dflash_train.pipeline.worker import die_with_parent
from dflash_train.profiling.flops import PEAK_BF16


def write_dataset(sequences, out: Path) -> Path:
    """The bench's synthetic sequences as a prepared dataset, for the worker processes to open."""
    ids = [sequences[i][0] for i in range(len(sequences))]
    masks = [sequences[i][1] for i in range(len(sequences))]
    write_sequences(out, ids, masks, [f"synthetic-{i}" for i in range(len(ids))], {"source": "dflash-train bench"})
    return out


def _steady_verdicts(profile_path: Path) -> dict[str, list[str]]:
    """Each process's verdict per profile window, without its first window (warm-up, compiles)."""
    by_process: dict[str, list[str]] = {}
    if not profile_path.is_file():
        return by_process
    for line in profile_path.read_text().splitlines():
        rec = json.loads(line)
        by_process.setdefault(rec["process"], []).append(rec["verdict"]["kind"])
    return {p: kinds[1:] or kinds for p, kinds in sorted(by_process.items())}


def run_split(bench_cfg, split: Split, kind: str, data_dir: Path, timed_flops: float, log=print) -> dict[str, Any]:
    """One split's run on `kind` devices; timed_flops = model FLOPs of its timed steps (bench/run.py)."""
    total = 2 * bench_cfg.steps
    with tempfile.TemporaryDirectory(prefix="dflash-bench-split-") as tmp:
        t_dev, d_dev = split.devices(kind)
        cfg = train_config(bench_cfg, Path(tmp), "overlap", total, data=str(data_dir), target_devices=t_dev,
                           drafter_devices=d_dev, profile_interval=1.0, init_from_target=False)
        t0 = time.perf_counter()
        # drafter_dir None: every drafter worker builds the same seeded drafter; no checkpoint files
        # plan None: every rank makes the same one (total is cfg's --max-steps)
        code = launch_workers(cfg, worker_roles(cfg), Path(tmp), data_dir, None, None, None, progress=False,
                              checkpoints=False)
        if code:
            raise RuntimeError(f"--splits {split.name}: the worker processes failed (exit {code}); see above")
        wall = time.perf_counter() - t0
        timed = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()][-1]
        verdicts = _steady_verdicts(Path(tmp) / "profile.jsonl")
    seconds = timed["elapsed_s"]
    res = {
        "gpus": split.gpus,
        "target_devices": t_dev,
        "drafter_devices": d_dev,
        "tokens_per_s": timed["target_tokens_per_s"],
        "block_tokens_per_s": timed["block_tokens_per_s"],
        "step_s": seconds / bench_cfg.steps,
        "mfu": timed_flops / seconds / (PEAK_BF16 * split.gpus) if kind == "cuda" else None,
        "target_capacity_tokens_per_s": timed["target_capacity_tokens_per_s"],
        "drafter_capacity_tokens_per_s": timed["drafter_capacity_tokens_per_s"],
        "verdict": split_verdict(verdicts),
        "verdicts": verdicts,
        "wall_s": wall,
        "loss_last": timed["loss"],
    }
    mfu = f", MFU {res['mfu']:.3f}" if res["mfu"] is not None else ""
    log(f"split {split.name:<6} {res['tokens_per_s']:>10,.0f} tokens/s on {split.gpus} device(s)  "
        f"{res['step_s'] * 1e3:8.1f} ms/step{mfu}, verdict {res['verdict']}")
    return res


def split_verdict(verdicts: dict[str, list[str]]) -> str:
    """The split's verdict from its processes' steady windows.

    Each process first gets its own majority verdict, so a stray window decides nothing. A
    one-role process cannot see the other role's waits (a drafter rank's "balanced" says only
    that it never waited for features), so the split is limited by whatever a process's
    majority names other than "balanced" (the most common such, if processes disagree), and
    balanced only when no process names a limit.
    """
    majorities = [Counter(k for k in ks if k != "idle").most_common(1) for ks in verdicts.values()]
    kinds = [m[0][0] for m in majorities if m]
    if not kinds:
        return "idle"
    limits = Counter(k for k in kinds if k != "balanced")
    return limits.most_common(1)[0][0] if limits else "balanced"


def _role_rates(one_gpu_tokens_per_s: float | None, splits: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Tokens/s one GPU gives in each role, from the measured splits (mean over the T+D splits)."""
    split_runs = [r for r in splits.values() if r["target_devices"] != r["drafter_devices"]]
    t = [r["target_capacity_tokens_per_s"] / len(r["target_devices"].split(",")) for r in split_runs
         if r.get("target_capacity_tokens_per_s")]
    d = [r["drafter_capacity_tokens_per_s"] / len(r["drafter_devices"].split(",")) for r in split_runs
         if r.get("drafter_capacity_tokens_per_s")]
    rates = {"both": one_gpu_tokens_per_s} if one_gpu_tokens_per_s else {}
    if t and d:
        rates |= {"target": sum(t) / len(t), "drafter": sum(d) / len(d)}
    return rates


def recommend(one_gpu_tokens_per_s: float | None, splits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per GPU count of the measured splits: the split the role rates predict fastest, checked by measurement.

    A T+D split delivers min(T x target rate, D x drafter rate) (the slower role sets the pace, as the
    verdicts say); xN delivers N x the one-GPU rate (a whole pipeline per GPU, only gradients cross).
    The rates come from the same run: the T+D splits' capacities (tokens per busy second of each role)
    and the best one-GPU variant. "confirmed" is whether the predicted best is the measured best
    (None when there was nothing to check: one candidate only, the predicted best not measured,
    or a measured split that was not predicted).
    """
    rates = _role_rates(one_gpu_tokens_per_s, splits)
    out: dict[str, Any] = {"rates_per_gpu": rates}
    for n in sorted({r["gpus"] for r in splits.values()}):
        predicted = {f"x{n}": n * rates["both"]} if "both" in rates else {}
        if "target" in rates:
            predicted |= {f"{k}+{n - k}": min(k * rates["target"], (n - k) * rates["drafter"]) for k in range(1, n)}
        if not predicted:
            continue
        best = max(predicted, key=predicted.get)
        measured = {name: r["tokens_per_s"] for name, r in splits.items() if r["gpus"] == n}
        top = max(measured, key=measured.get)
        # a check needs a choice (two candidates or more) and every measured split among them
        checkable = len(predicted) > 1 and best in measured and set(measured) <= set(predicted)
        out[str(n)] = {"recommended": best, "predicted_tokens_per_s": predicted, "measured_best": top,
                       "confirmed": (best == top) if checkable else None}
    return out


# --- the link ---------------------------------------------------------------------------------


def device_copy_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes/s of one copy from GPU 0 to GPU 1 in one process (peer access where the host allows it)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    return nbytes * repeats / (time.perf_counter() - t0)


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: NCCL connects on first use
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _link_worker(rank: int, port: int, width: int, budget: int, depth: int, messages: int, out) -> None:
    """Rank 0 (GPU 0) sends, rank 1 (GPU 1) receives; rank 0 times and reports."""
    die_with_parent()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    result = {"device_copy_bytes_per_s": device_copy_bandwidth()} if rank == 0 else {}
    torch.cuda.empty_cache()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=dev,
                            timeout=timedelta(seconds=120))
    big = torch.empty(2**30, dtype=torch.uint8, device=dev)

    def raw() -> None:
        dist.send(big, 1) if rank == 0 else dist.recv(big, 0)
    result["nccl_send_recv_bytes_per_s"] = big.numel() * 5 / _timed(raw, 5)

    # The hand-off code itself. Timed on the sender: a send completes once it was received, and
    # the receiver's receives are posted ahead (--queue-depth), as in a run.
    warm = 2
    packs = [SimpleNamespace(index=i, num_tokens=budget) for i in range(warm + messages)]
    if rank == 0:
        feats = TargetFeatures(torch.randn(budget, width, dtype=torch.bfloat16, device=dev))
        sender = P2PSender(depth, 120, str)
        for p in packs[:warm]:
            sender.send(p.index, 1, feats, 0.0)
        sender.flush()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p in packs[warm:]:
            sender.send(p.index, 1, feats, 0.0)
        sender.flush()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        nbytes = budget * width * 2
        out.put(result | {"handoff_bytes_per_s": nbytes * messages / seconds, "handoff_message_bytes": nbytes,
                          "handoff_message_ms": seconds / messages * 1e3})
    else:
        receiver = P2PReceiver(iter(packs), lambda p: 0, width, budget, torch.bfloat16, dev, depth, 120, str)
        for _ in packs:
            receiver.get()
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def link_bandwidth(width: int, budget: int, depth: int, messages: int = 20) -> dict[str, Any]:
    """GPU 0 -> GPU 1: a device copy, NCCL send/recv of 1 GiB, and the pipeline's hand-off of features.

    In two worker processes, so this process never holds a CUDA context.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_link_worker, args=(r, port, width, budget, depth, messages, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                return out.get(timeout=1.0)
            except queue.Empty:
                failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or all(p.exitcode == 0 for p in procs):
                    raise RuntimeError(f"link measurement: worker (rank, exit code) {failed} ended without a result; "
                                       "see its traceback above") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()


def scaling(one_gpu_tokens_per_s: float | None, splits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per GPU count: the best split and its efficiency against N x the best one-GPU figure."""
    by_n: dict[int, tuple[str, dict]] = {}
    for name, res in splits.items():
        n = res["gpus"]
        if n not in by_n or res["tokens_per_s"] > by_n[n][1]["tokens_per_s"]:
            by_n[n] = (name, res)
    out = {}
    for n, (name, res) in sorted(by_n.items()):
        eff = res["tokens_per_s"] / (n * one_gpu_tokens_per_s) if one_gpu_tokens_per_s else None
        out[str(n)] = {"split": name, "tokens_per_s": res["tokens_per_s"], "mfu": res["mfu"],
                       "scaling_efficiency": eff}
    return out
