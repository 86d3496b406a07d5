"""The body of one worker process of a multi-process run (started by pipeline/launcher.py).

Ranks 0..T-1 are target workers, T..T+D-1 drafter workers. Every process joins one
torch.distributed group (NCCL on GPU, gloo on CPU); the drafter ranks also form the group
their DistributedDataParallel all-reduces over. Pack p is computed by target rank p % T and
trained on by drafter rank T + p % D.

A "both" rank holds a whole pipeline on its device (the same device list given to both flags):
its target thread feeds its drafter through a local queue, and only gradients cross devices.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_train.errors import UsageError
from dflash_train.objective.objective import feature_layer_ids
from dflash_train.pipeline.drafter_loop import DataParallel, DrafterTrainLoop, GracefulStop
from dflash_train.pipeline.handoff import P2PReceiver, P2PSender
from dflash_train.pipeline.stream import Pack, PackStream, StreamState
from dflash_train.pipeline.target_loop import BatchQueue, FeatureCache, TargetForwardLoop
from dflash_train.profiling.session import profile_session
from dflash_train.training.config import TrainConfig

FAULT_ENV = "DFLASH_TRAIN_FAULT"  # testing aid: "target:P" / "drafter:P" raises at pack P in that role


@dataclass
class WorkerSpec:
    rank: int
    role: str  # "target" | "drafter" | "both" (a target thread feeding this process's drafter)
    device: str
    devices: list[tuple[str, str]]  # (role, device) of every rank
    cfg: TrainConfig
    run_dir: str
    data_dir: str
    drafter_dir: str | None  # initial weights (fresh init or the checkpoint resumed from); None = a fresh init here
    resume_state_path: str | None  # drafter ranks restore optimizer, schedule and RNGs from it
    stream: StreamState  # where the run's pack stream starts (a resumed run's position)
    total_steps: int
    init_method: str  # torch.distributed rendezvous: tcp://127.0.0.1:PORT (launcher) or env:// (torchrun)
    progress: bool
    checkpoints: bool = True  # False: no checkpoint files at all (the benchmark's runs)

    @property
    def trains(self) -> bool:
        return self.role != "target"

    @property
    def target_ranks(self) -> list[int]:
        return [r for r, (role, _) in enumerate(self.devices) if role != "drafter"]

    @property
    def drafter_ranks(self) -> list[int]:
        return [r for r, (role, _) in enumerate(self.devices) if role != "target"]

    def describe(self, rank: int) -> str:
        role, device = self.devices[rank]
        return f"rank {rank} ({role}, {device})"


def _die_with_parent() -> None:
    """Linux: the kernel kills this process if the launcher dies (even by kill -9)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _fault(role: str):
    want_role, _, at = os.environ.get(FAULT_ENV, "").partition(":")
    if want_role != role or not at:
        return None
    at_pack = int(at)

    def check(pack: Pack) -> None:
        if pack.index == at_pack:
            raise RuntimeError(f"injected fault in the {role} loop at pack {at_pack} ({FAULT_ENV})")
    return check


def _with_fault(role: str, packs):
    """packs, raising at DFLASH_TRAIN_FAULT's pack when it names `role`."""
    fault = _fault(role)
    return packs if fault is None else (fault(p) or p for p in packs)


def worker_main(spec: WorkerSpec, heartbeats, steps, stop_at) -> None:
    _die_with_parent()
    # The launcher coordinates Ctrl-C and SIGTERM (a terminal or a scheduler signals the whole group);
    # it ends workers with SIGKILL when it has to.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("DFLASH_TRAIN_DEBUG_STACKS"):
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["DFLASH_TRAIN_DEBUG_STACKS"]), exit=False)
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # not tqdm's multiprocessing lock: os._exit below would leak its semaphore
    code = 0
    try:
        run_worker(spec, heartbeats, steps, stop_at)
    except GracefulStop:
        code = 0
    except UsageError as e:  # e.g. a diverged run: one line, like the single-process command
        print(f"[dflash-train] worker {spec.describe(spec.rank)}: error: {e}", file=sys.stderr)
        code = e.exit_code
    except BaseException:
        print(f"[dflash-train] worker {spec.describe(spec.rank)} failed:", file=sys.stderr)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # No destroy_process_group: with a peer gone it can block; the process is ending anyway.
    os._exit(code)


def run_worker(spec: WorkerSpec, heartbeats, steps, stop_at):
    """Join the process group and run this rank's loop; a drafter rank returns its trained drafter."""
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # share the host's cores between the worker processes
        local = int(os.environ.get("LOCAL_WORLD_SIZE", len(spec.devices)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    heartbeats[spec.rank] = time.time()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank, world_size=len(spec.devices),
                            timeout=timedelta(seconds=spec.cfg.peer_timeout))
    group = dist.new_group(spec.drafter_ranks)  # every rank takes part in creating it
    with profile_session(spec.cfg, Path(spec.run_dir), f"rank{spec.rank}/{spec.role}/{spec.device}") as session:
        if spec.role == "target":
            return _run_target(spec, device, session, heartbeats)
        return _run_drafter(spec, device, session, group, heartbeats, steps, stop_at)


def _stream(spec: WorkerSpec, state: StreamState, dataset) -> PackStream:
    cfg = spec.cfg
    return PackStream(dataset, cfg.token_budget, cfg.num_anchors, cfg.seed,
                      len(spec.drafter_ranks) * cfg.grad_accum, state)


def _resume_state(spec: WorkerSpec):
    if spec.resume_state_path is None:
        return None
    from dflash_train.training.checkpoint import load_state

    return load_state(Path(spec.resume_state_path))


def _run_target(spec: WorkerSpec, device: torch.device, session, heartbeats) -> None:
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.models.checkpoint import load_config
    from dflash_train.models.targets import load_target

    cfg = spec.cfg
    target = load_target(cfg.target, device=device)
    if spec.drafter_dir is not None:
        drafter_cfg = load_config(spec.drafter_dir)
    else:
        from dflash_train.training.job import drafter_config

        drafter_cfg = drafter_config(cfg, target)
    layer_ids = feature_layer_ids(drafter_cfg, cfg.kd_weight > 0)
    stream = _stream(spec, spec.stream, PreparedDataset.open(spec.data_dir, labels=cfg.labels == "target"))
    t_ranks, d_ranks = spec.target_ranks, spec.drafter_ranks
    me = t_ranks.index(spec.rank)
    packs = stream.packs(spec.total_steps, keep=lambda p: p.index % len(t_ranks) == me)
    prof = session.stats.loop("target")
    from dflash_train.pipeline.local import cache_features

    cache = FeatureCache() if cache_features(cfg, device) else None  # each worker caches the packs it serves
    loop = TargetForwardLoop(target, layer_ids, prof, _fault("target"), session.trace, cache)
    sender = P2PSender(cfg.queue_depth, cfg.peer_timeout, spec.describe)

    def beat() -> None:
        heartbeats[spec.rank] = time.time()

    with target.compiled_layers(cfg.compile_target):
        loop.run_p2p(BatchQueue(packs, cfg.queue_depth, prof), sender, lambda p: d_ranks[p.index % len(d_ranks)],
                     beat)


def _run_drafter(spec: WorkerSpec, device: torch.device, session, group, heartbeats, steps, stop_at):
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.models.checkpoint import load_drafter
    from dflash_train.models.targets import default_dtype, load_target

    cfg = spec.cfg
    # A drafter-only worker uses the target's embedding and LM head (and its last layers once, to
    # initialise the drafter), so a real target loads on the host and only those reach the GPU.
    # Random targets are drawn on the device, so that they equal the target workers' draw.
    head_only = spec.role == "drafter"
    on_host = head_only and not cfg.target.startswith("random:")
    # the dtype of the device that computes, not of the host it loads on (as target workers load it)
    target = load_target(cfg.target, device="cpu" if on_host else device, dtype=default_dtype(device))
    if spec.drafter_dir is not None:
        drafter = load_drafter(spec.drafter_dir, dtype=torch.float32).to(device)
    else:  # seeded, so every drafter rank builds the same one (DDP also broadcasts rank 0's)
        from dflash_train.training.job import make_drafter

        drafter = make_drafter(cfg, target, None).to(device)
    if head_only:
        target.keep_only_head(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # a random target's layers were allocated here first
    t_ranks, d_ranks = spec.target_ranks, spec.drafter_ranks
    me = d_ranks.index(spec.rank)
    prof = session.stats.loop("drafter")

    def beat(step: int) -> None:
        heartbeats[spec.rank] = time.time()
        steps[spec.rank] = step

    def stop_requested(step: int) -> bool:
        return 0 <= stop_at.value <= step

    loop = DrafterTrainLoop(cfg, drafter, target.embedding_weight, target.lm_head, Path(spec.run_dir), spec.total_steps,
                            dp=DataParallel(me, len(d_ranks), group if len(d_ranks) > 1 else None),
                            resume_state=_resume_state(spec), progress=spec.progress and me == 0, prof=prof,
                            stop_requested=stop_requested, heartbeat=beat, target_workers=len(t_ranks),
                            trace=session.trace, checkpoints=spec.checkpoints)
    stream = _stream(spec, loop.stream_state, PreparedDataset.open(spec.data_dir, labels=cfg.labels == "target"))
    packs = _with_fault("drafter", stream.packs(spec.total_steps, keep=lambda p: p.index % len(d_ranks) == me))
    if spec.role == "both":
        from dflash_train.pipeline.local import local_source

        packs = _with_fault("target", packs)  # fires where this process's target reads the pack
        source = local_source(cfg, target, packs, feature_layer_ids(drafter.config, cfg.kd_weight > 0),
                              session.stats, session.trace)
    else:
        width = len(feature_layer_ids(drafter.config, cfg.kd_weight > 0)) * target.hidden_size
        source = P2PReceiver(packs, lambda p: t_ranks[p.index % len(t_ranks)], width, cfg.token_budget, target.dtype,
                             device, cfg.queue_depth, cfg.peer_timeout, spec.describe)
    try:
        with target.compiled_layers(cfg.compile_target and spec.role == "both"):
            loop.train(source)
    finally:
        source.close()
    return drafter

