"""`dflash-train bench`: the real training pipeline on a random target of real shapes, measured.

    dflash-train bench --target random:qwen3-8b --num-layers 5 --block-size 16 --num-anchors 512 \\
        --seq-len 3072 --steps 10 --json benchmarks/results/h200-qwen3-8b.json

Each variant runs in a fresh process (as a `dflash-train train` run does) and trains the same
freshly initialised drafter on the same packs (synthetic sequences of --seq-len tokens, the loss
on all but the first 10%; one a pack, or as many as --token-budget holds, as a real data set's
packs hold several) for 2 x --steps optimizer steps: the first --steps are warm-up (compilation,
allocator), the second --steps are timed (one host sync at each end); its time to the first
optimizer step counts from its process start (--cold-start: with empty compile caches, as on a
fresh machine; otherwise whatever earlier runs left in them). Variants:

    sequential    target forward, then drafter step, strictly one after the other (the naive loop)
    overlap       the target on its own thread and CUDA stream, feeding a bounded queue
    overlap+wall  the same with profiling on (wall clock, --profile-interval 10)
    overlap+cuda  the same with profiling on (CUDA events); both profiled variants record their last
                  window's stage shares and busy clocks and its verdict, and every window's verdict
    target-only   only the target forwards of the timed packs (what the target role costs alone)
    drafter-only  only the drafter steps: features cached during warm-up (the data has --steps sequences,
                  so the timed steps revisit them with new anchors)

--target-experts eager,grouped_mm runs every variant under each experts kernel of a mixture-of-experts
target (models/experts.py), named variant@kernel, side by side in one record.

MFU = model FLOPs of the timed steps (profiling/flops.py; an MoE target's active parameters) / (seconds x
peak), peak 989 TFLOP/s (H200 dense BF16) on CUDA; on CPU no MFU is reported. --splits adds several-GPU
runs (bench/multi.py).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import platform
import queue
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dflash_train.app.local import train_local
from dflash_train.bench.config import BenchConfig, check_gpus, parse_splits, train_config
from dflash_train.bench.multi import link_bandwidth, recommend, run_split, scaling, write_dataset
from dflash_train.data.synthetic import SyntheticSequences
from dflash_train.devices import resolve_device
from dflash_train.models.experts import use_experts
from dflash_train.models.factory import drafter_config_for, new_drafter
from dflash_train.models.loading import load_target
from dflash_train.pipeline.features import packed_features
from dflash_train.pipeline.stream import PackStream
from dflash_train.pipeline.worker import die_with_parent
from dflash_train.profiling import host_load
from dflash_train.profiling.flops import PEAK_BF16, PackFlops
from dflash_train.profiling.report import load_records
from dflash_train.profiling.reporter import ProfileReporter
from dflash_train.profiling.stats import NULL_PROFILE, ProfileStats


def _synthetic(cfg: BenchConfig, vocab: int) -> SyntheticSequences:
    """The bench's data: --steps packs of --seq-len sequences, as many a pack as --token-budget holds."""
    return SyntheticSequences(cfg.steps * cfg.seqs_per_pack, cfg.seq_len, vocab, cfg.seed)


def _step_flops(cfg: BenchConfig, target, drafter, dataset, first: int, last: int,
                packs_per_step: int = 1) -> tuple[float, float]:
    """Model FLOPs of steps [first, last) from the very packs the stream yields (deterministic)."""
    counter = PackFlops.build(target.model.config, drafter.config, list(drafter.config.target_layer_ids),
                              target.vocab_size)
    stream = PackStream(dataset, cfg.pack_tokens, cfg.num_anchors, cfg.seed, packs_per_step)
    t_total = d_total = 0.0
    for pack in stream.packs(last):
        if pack.step < first:
            continue
        t_total += counter.target_of(pack)
        d_total += counter.drafter_of(pack)
    return t_total, d_total


def _target_only(cfg: BenchConfig, target, drafter, dataset, total: int, device: torch.device) -> dict[str, Any]:
    """The target forwards of the timed packs alone, after the warm-up packs."""
    layer_ids = list(drafter.config.target_layer_ids)
    packs = list(PackStream(dataset, cfg.pack_tokens, cfg.num_anchors, cfg.seed, 1).packs(total))
    tokens, t0 = 0, 0.0
    for i, pack in enumerate(packs):
        if i == cfg.steps:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # host sync: the timed window starts here
            t0 = time.perf_counter()
        packed_features(target, pack.batch, layer_ids)
        tokens += pack.num_tokens if i >= cfg.steps else 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": tokens / seconds, "step_s": seconds / cfg.steps,
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def run_bench(cfg: BenchConfig, log=print) -> dict[str, Any]:
    """Each variant in a fresh process, as a `dflash-train train` run would be; then the splits."""
    device = resolve_device(cfg.device)
    splits = parse_splits(cfg.splits)
    check_gpus(splits, device)
    results: dict[str, Any] = {}
    plan = None
    runs = cfg.runs()
    width = max(14, *(len(name) for name, _, _ in runs))
    for name, variant, experts in runs:
        # A second training loop in one process ran the overlapped pipeline ~12% slower than the
        # first on the H200 (not a recompile, not the allocator, not GC; docs/performance.md), so
        # no variant inherits another's process.
        # time to first step: from this variant's process start (a `train` launch), whatever ran before
        with _compile_caches(cfg.cold_start):
            res, plan = _in_fresh_process(_run_variant, cfg, variant, experts, str(device), time.perf_counter())
        results[name] = res
        mfu = f", MFU {res['mfu']:.3f}" if res["mfu"] is not None else ""
        blocks = f"  {res['block_tokens_per_s']:>10,.0f} block tokens/s" if "block_tokens_per_s" in res else ""
        verdict = f"  verdict {res['verdict']['kind']}" if "verdict" in res else ""
        log(f"{name:<{width}} {res['tokens_per_s']:>10,.0f} tokens/s{blocks}  {res['step_s'] * 1e3:8.1f} ms/step"
            f"{mfu}{verdict}")
    if plan is None:
        plan = _in_fresh_process(_plan_only, cfg, str(device))
    out = _summary(cfg, plan, results)
    if splits:
        out = _multi_summary(out, _run_splits(cfg, splits, device.type, plan, log))
        _log_multi(out, log)
    return out


@contextlib.contextmanager
def _compile_caches(cold: bool):
    """--cold-start: the child process gets empty inductor and Triton caches (a fresh machine's first run)."""
    if not cold:
        yield
        return
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in names}
    with tempfile.TemporaryDirectory(prefix="dflash-bench-cold-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
        try:
            yield  # the spawned child reads its environment at start
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _log_multi(out: dict[str, Any], log) -> None:
    """Per GPU count: the best measured split, its scaling, and whether the role rates predicted it."""
    for n, best in out["by_gpus"].items():
        eff = f", scaling efficiency {best['scaling_efficiency']:.3f}" if best["scaling_efficiency"] else ""
        rec = out["recommendation"].get(n)
        verdict = ""
        if rec:
            verdict = {True: "confirmed", False: "not confirmed", None: "not measured"}[rec["confirmed"]]
            verdict = f"; predicted best {rec['recommended']} ({verdict})"
        log(f"{n} device(s): best split {best['split']} {best['tokens_per_s']:,.0f} tokens/s{eff}{verdict}")


def _in_fresh_process(fn, *args):
    """fn(*args) in a spawned process; its exception is re-raised here with the child's traceback."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(q, fn, args), name=f"dflash-bench-{fn.__name__}")
    proc.start()
    try:
        while True:
            try:
                status, value = q.get(timeout=1.0)
                break
            except queue.Empty:  # check that the child is still alive
                if proc.exitcode is not None and q.empty():
                    raise RuntimeError(f"bench process {fn.__name__}{args[1:3]} died (exit {proc.exitcode})") from None
    finally:
        proc.join(timeout=60)
        if proc.exitcode is None:
            proc.kill()
    if status == "error":
        raise RuntimeError(f"bench {fn.__name__}{args[1:3]} failed:\n{value}")
    return value


def _child(q, fn, args) -> None:
    die_with_parent()  # a bench killed with -9 leaves no GPU process behind
    try:
        q.put(("ok", fn(*args)))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def _setup(cfg: BenchConfig, device_name: str):
    """The target, a freshly initialised drafter, the synthetic data and the FLOP plan (same in every process)."""
    device = torch.device(device_name)
    cuda = device.type == "cuda"
    target = load_target(cfg.target, device=device, seed=cfg.seed)
    dcfg = drafter_config_for(target, num_layers=cfg.num_layers, block_size=cfg.block_size, dtype="bfloat16",
                              intermediate_size=cfg.intermediate_size, num_sliding_layers=cfg.sliding_layers,
                              sliding_window=cfg.sliding_window, num_key_value_heads=cfg.num_key_value_heads)
    drafter = new_drafter(dcfg, cfg.seed, device)  # the device's generator: the same weights in every process
    dataset = _synthetic(cfg, target.vocab_size)
    total = 2 * cfg.steps
    t_flops, d_flops = _step_flops(cfg, target, drafter, dataset, cfg.steps, total)
    plan = {
        "t_flops": t_flops, "d_flops": d_flops, "flops": t_flops + d_flops,
        "split_flops": {s.name: sum(_step_flops(cfg, target, drafter, dataset, cfg.steps, total, s.drafters))
                        for s in parse_splits(cfg.splits)},
        "width": len(dcfg.target_layer_ids) * target.hidden_size,
        "vocab": target.vocab_size,
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
    }
    return target, drafter.to(device=device, dtype=torch.float32), dataset, plan


def _plan_only(cfg: BenchConfig, device_name: str) -> dict[str, Any]:
    return _setup(cfg, device_name)[3]


def _run_variant(cfg: BenchConfig, variant: str, experts: str, device_name: str, t_launch: float):
    target, drafter, dataset, plan = _setup(cfg, device_name)
    kernel = use_experts(target.model, experts)  # None: a dense target
    device = target.device
    cuda = device.type == "cuda"
    total = 2 * cfg.steps
    if variant == "target-only":
        with target.compiled_layers(cfg.compile_target):
            res = _target_only(cfg, target, drafter, dataset, total, device)
        res["mfu"] = plan["t_flops"] / (res["step_s"] * cfg.steps) / PEAK_BF16 if cuda else None
    else:
        res = _train_variant(cfg, variant, experts, target, drafter, dataset, plan, t_launch)
    res["experts"] = kernel
    return res, plan


def _train_variant(cfg: BenchConfig, variant: str, experts: str, target, drafter, dataset, plan,
                   t_launch) -> dict[str, Any]:
    device = target.device
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        tcfg = train_config(cfg, Path(tmp), variant, 2 * cfg.steps, experts)
        profiled = "+" in variant
        # as `train` profiles: allocator telemetry on CUDA too; the records go to tmp/profile.jsonl for the verdicts
        stats = ProfileStats(f"bench/{variant}", cuda_events=tcfg.profiling.profile_cuda_events,
                             memory_stats=(lambda: torch.cuda.memory_stats(device)) if cuda else None,
                             host=host_load.snapshot) \
            if profiled else NULL_PROFILE
        reporter = ProfileReporter(stats, 10.0, Path(tmp), log=lambda text: None, tensorboard=False).start() \
            if profiled else None
        loops = []
        t0 = time.perf_counter()
        result = train_local(tcfg, target, drafter, dataset, Path(tmp), progress=False, stats=stats,
                             checkpoints=False, on_loop=loops.append)
        last_profile = reporter.emit() if reporter else None
        if reporter:
            reporter.stop()
        windows = load_records(Path(tmp) / "profile.jsonl") if profiled else []
    timed = result.last_record  # the record of the timed steps (log_every = --steps), as metrics.jsonl ends
    seconds = timed["elapsed_s"]
    work = plan["d_flops"] if variant == "drafter-only" else plan["flops"]
    res = {
        "tokens_per_s": timed["target_tokens_per_s"],
        "block_tokens_per_s": timed["block_tokens_per_s"],
        "step_s": seconds / cfg.steps,
        "model_tflop_per_step": work / cfg.steps / 1e12,
        "mfu": work / seconds / PEAK_BF16 if cuda else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "first_step_s": loops[0].first_step_at - t0,
        "loss_last": timed["loss"],
    }
    res["time_to_first_step_s"] = loops[0].first_step_at - t_launch  # CLOCK_MONOTONIC: same in every process
    if last_profile is not None:  # the last window (the timed steps and the end of the warm-up)
        keep = ("share", "p95_ms", "host_busy", "device_busy", "starved_share")
        res["profile"] = {loop: {k: {key: v[key] for key in keep if key in v} for k, v in d["stages"].items()}
                          for loop, d in last_profile["loops"].items()}
        res["verdict"] = last_profile["verdict"]
        res["verdicts"] = [w["verdict"]["kind"] for w in windows]  # every window's, in order
    return res


def _run_splits(cfg: BenchConfig, splits, kind: str, plan: dict[str, Any], log) -> dict[str, Any]:
    link = None
    if kind == "cuda" and any(not s.colocated for s in splits):
        link = link_bandwidth(plan["width"], cfg.pack_tokens, depth=4)
        log(f"link GPU0->GPU1: device copy {link['device_copy_bytes_per_s'] / 1e9:.0f} GB/s, NCCL send/recv "
            f"{link['nccl_send_recv_bytes_per_s'] / 1e9:.0f} GB/s, "
            f"hand-off {link['handoff_bytes_per_s'] / 1e9:.0f} GB/s "
            f"({link['handoff_message_bytes'] / 1e6:.0f} MB per pack, {link['handoff_message_ms']:.2f} ms)")
    with tempfile.TemporaryDirectory(prefix="dflash-bench-data-") as tmp:
        data_dir = write_dataset(_synthetic(cfg, plan["vocab"]), Path(tmp) / "data")
        results = {s.name: run_split(cfg, s, kind, data_dir, plan["split_flops"][s.name], log) for s in splits}
    return {"splits": results, "link": link}


def _multi_summary(one: dict[str, Any], multi: dict[str, Any]) -> dict[str, Any]:
    """The several-GPU record: the best split on the most GPUs, scaling against one GPU's best variant."""
    by_gpus = scaling(one["tokens_per_s"], multi["splits"])  # one GPU: its best trained variant
    top = by_gpus[max(by_gpus, key=int)]
    return {
        "gpus": max(int(n) for n in by_gpus),
        "split": top["split"],
        "tokens_per_s": top["tokens_per_s"],
        "mfu": top["mfu"],
        "scaling_efficiency": top["scaling_efficiency"],
        "by_gpus": by_gpus,
        "recommendation": recommend(one["tokens_per_s"], multi["splits"]),
        "splits": multi["splits"],
        "link": multi["link"],
        "device": f"{torch.cuda.device_count()} x {one['device']}" if torch.cuda.is_available() else one["device"],
        "versions": one["versions"],
        "config": one["config"],
        "one_gpu": one,  # the whole one-GPU record of the same run (its best variant is the baseline)
    }


def _summary(cfg: BenchConfig, plan: dict[str, Any], results: dict) -> dict[str, Any]:
    import transformers

    # the -only variants do half the work (names: the variant, or variant@experts)
    trained = [v for v in results if not v.partition("@")[0].endswith("-only")]
    best = max(trained, key=lambda v: results[v]["tokens_per_s"]) if trained else None
    top = results[best] if best else {}
    out: dict[str, Any] = {
        "tokens_per_s": top.get("tokens_per_s"),
        "block_tokens_per_s": top.get("block_tokens_per_s"),
        "mfu": top.get("mfu"),
        "best_variant": best,
        "peak_memory_gb": top.get("peak_memory_gb"),
        "time_to_first_step_s": top.get("time_to_first_step_s"),
        "device": plan["device"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "config": asdict(cfg),
        "model_tflop_per_step": plan["flops"] / cfg.steps / 1e12,
        "target_tflop_per_step": plan["t_flops"] / cfg.steps / 1e12,
        "variants": results,
    }
    if "sequential" in results and "overlap" in results:
        out["vs_sequential"] = results["overlap"]["tokens_per_s"] / results["sequential"]["tokens_per_s"]
    if "overlap" in results:
        for v in ("overlap+wall", "overlap+cuda"):
            if v in results:
                out[f"profile_overhead_{v.split('+')[1]}"] = (
                    1 - results[v]["tokens_per_s"] / results["overlap"]["tokens_per_s"])
    return out

