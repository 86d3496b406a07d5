"""The train job on several processes: one per device of --target-devices / --drafter-devices.

    worker_roles(cfg)    (role, device) per process, or [] for the one-device path
    launch_workers(...)  starts them on this host (pipeline/launcher.py) and returns the run's exit code
    run_torchrun_rank    one rank of a torchrun launch (the role split repeated per node)
    run_rank(work, ...)  what one rank does: loads its target (and drafter), then serves features or trains

pipeline/worker.py has the process around a rank and the feature plumbing; this module has the
train job's part of it: which target and drafter, which training loop.
"""

from __future__ import annotations

import functools
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from dflash_train.app.dataset import open_prepared
from dflash_train.app.drafter import drafter_config, drafter_side_target, make_drafter
from dflash_train.app.local import feature_cache, features_here, flop_counter, train_loop
from dflash_train.app.plan import RunPlan
from dflash_train.app.run_dir import export_drafter, run_dir_lock, write_config
from dflash_train.app.validation import VALIDATION_FILE, Awaited, Validation, validation_key
from dflash_train.errors import UsageError
from dflash_train.models.checkpoint import load_config, load_drafter
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.experts import use_experts
from dflash_train.models.loading import load_target
from dflash_train.models.sharded_loading import load_sharded_target
from dflash_train.pipeline.launcher import Launcher, free_port, parse_devices
from dflash_train.pipeline.worker import Peers, WorkerSpec, drafter_packs, join_group, receive_features, serve_features
from dflash_train.profiling.session import profile_session
from dflash_train.settings.tree import TrainConfig
from dflash_train.training.checkpoint import latest_checkpoint, load_state
from dflash_train.training.trainer import DataParallel, GracefulStop, Hooks


@dataclass
class TrainWork:
    """What every rank of one run is given (the launcher sends it to each process)."""

    cfg: TrainConfig
    run_dir: str
    data_dir: str
    drafter_dir: str | None  # initial weights (fresh init or the checkpoint resumed from); None = a fresh init here
    resume_state_path: str | None  # drafter ranks restore optimizer, schedule and RNGs from it
    plan: RunPlan | None  # the job's (app/plan.py); None under torchrun, where each rank makes the same one
    progress: bool
    checkpoints: bool = True  # False: no checkpoint files at all (the benchmark's runs)
    validation_path: str | None = None  # the held-out packs (app/validation.py): every drafter rank validates


def worker_roles(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(role, device) per worker process, or [] for the one-device path."""
    if cfg.pipeline.target_devices is None:
        return []
    targets = parse_devices(cfg.pipeline.target_devices, "--target-devices")
    drafters = parse_devices(cfg.pipeline.drafter_devices, "--drafter-devices")
    tp = cfg.pipeline.target_tp
    if tp > 1 and (targets == drafters or len(targets) % tp):
        raise UsageError(f"--target-tp {tp}: --target-devices lists {len(targets)} devices, which must be a multiple "
                         f"of {tp} and apart from --drafter-devices (the target's replicas, {tp} devices each)")
    if targets == drafters:  # every device runs a whole pipeline; the drafters are data parallel
        out = [("both", d) for d in targets]
    else:
        out = [("target", d) for d in targets] + [("drafter", d) for d in drafters]
    cuda = [d for _, d in out if d.startswith("cuda")]
    if len(set(cuda)) < len(cuda):
        raise UsageError("--target-devices/--drafter-devices: a CUDA device can hold one worker process (NCCL); "
                         "to put a target and a drafter on every GPU give both flags the same list, in the same order")
    if len({torch.device(d).type for _, d in out}) > 1:
        raise UsageError("--target-devices and --drafter-devices must all be CUDA devices or all cpu "
                         "(features travel over NCCL or gloo)")
    return out


def drafter_count(roles) -> int:
    """The processes that train a drafter (one on the one-device path, which has no roles)."""
    return sum(1 for role, _ in roles if role != "target") or 1


def launch_workers(cfg: TrainConfig, roles, run_dir: Path, data_dir, drafter_dir: str | None, ckpt: Path | None,
                   plan: RunPlan | None, progress: bool, checkpoints: bool = True,
                   validation: Path | None = None) -> int:
    """One process per (role, device) on this host, started and watched by the Launcher; its exit code."""
    port = cfg.pipeline.dist_port or free_port()
    work = TrainWork(cfg=cfg, run_dir=str(run_dir), data_dir=str(data_dir), drafter_dir=drafter_dir,
                     resume_state_path=str(ckpt) if ckpt else None, plan=plan, progress=progress,
                     checkpoints=checkpoints,
                     validation_path=str(validation) if validation is not None else None)
    specs = [WorkerSpec(rank=r, role=role, device=dev, devices=roles, init_method=f"tcp://127.0.0.1:{port}",
                        peer_timeout=cfg.pipeline.peer_timeout, tp=cfg.pipeline.target_tp)
             for r, (role, dev) in enumerate(roles)]
    return Launcher(specs, functools.partial(run_rank, work)).run(cfg.pipeline.peer_timeout)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_torchrun_rank(cfg: TrainConfig, roles, resume: bool, progress: bool) -> NoReturn:
    """One rank of a torchrun launch: the role split of --target/--drafter-devices, repeated per node.

    torchrun starts the processes on every node and ends them all when one fails; this rank
    takes (role, device) = roles[LOCAL_RANK]. The data must be prepared beforehand (a prepared
    dataset directory in --data) and the run directory shared by the nodes.
    """
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", len(roles)))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if local_world != len(roles):
        raise UsageError(f"torchrun --nproc-per-node must be {len(roles)} (one process per device of "
                         f"--target-devices and --drafter-devices), got {local_world}")
    if not (Path(cfg.data.data) / "meta.json").is_file():
        raise UsageError(f"--data {cfg.data.data}: under torchrun give a prepared dataset directory "
                         "(dflash-train prepare / regenerate first)")
    dataset = open_prepared(cfg, cfg.data.data)
    run_dir = Path(cfg.run.run_dir)
    devices = roles * (world // local_world)
    # The first drafter rank writes metrics, checkpoints and the drafter: it holds the run directory's lock.
    writer = rank == next(r for r, (role, _) in enumerate(devices) if role != "target")
    with run_dir_lock(run_dir) if writer else nullcontext():
        ckpt = latest_checkpoint(run_dir) if resume else None
        spec = WorkerSpec(rank=rank, role=roles[local_rank][0], device=roles[local_rank][1], devices=devices,
                          init_method="env://", peer_timeout=cfg.pipeline.peer_timeout, tp=cfg.pipeline.target_tp)
        work = TrainWork(cfg=cfg, run_dir=str(run_dir), data_dir=str(dataset.path),
                         drafter_dir=str(ckpt / "drafter") if ckpt else cfg.drafter.init_drafter,
                         resume_state_path=str(ckpt) if ckpt else None, plan=None, progress=progress)
        if writer:
            write_config(run_dir, cfg)
        drafter = run_rank(work, spec, Peers.unwatched(len(devices)))
        if writer:  # the first target replica's held-out packs: read by every drafter rank, which is done
            (run_dir / VALIDATION_FILE).unlink(missing_ok=True)
        if drafter is not None and writer:
            export = export_drafter(drafter, run_dir, cfg)
            print(f"drafter exported to {export}; measure it with `dflash-train eval --drafter {export}`")
    # Leave without interpreter teardown, as the launcher's workers do (pipeline/worker.py): with
    # the process group's threads still alive at exit, a gloo rank aborted in std::terminate in
    # about 1 of 4 CPU runs after the work had finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(work: TrainWork, spec: WorkerSpec, peers: Peers) -> DFlashDrafter | None:
    """Join the process group and run this rank's loop; a drafter rank returns its trained drafter
    (None after the launcher's coordinated stop: the checkpoint of that step is written)."""
    groups = join_group(spec, peers)
    label = f"rank{spec.rank}/{spec.role}/{spec.device}"
    with profile_session(work.cfg.profiling, Path(work.run_dir), label, work.cfg.oom_hint()) as session:
        if spec.role == "target":
            return _serve(work, spec, peers, session, groups.tp)
        try:
            return _train(work, spec, peers, session, groups.drafters)
        except GracefulStop:
            return None


def _validation(work: TrainWork, spec: WorkerSpec, plan: RunPlan, dataset, target,
                device: torch.device) -> Validation | Awaited | None:
    """The held-out packs a drafter rank validates on: the job's saved ones; where no job holds the whole
    target before the ranks start, the first target replica's (a drafter-only rank awaits its file), or
    built here by a rank with both roles, on its own device. Every drafter rank has the same ones (the
    split and the packing are seeded)."""
    cfg = work.cfg
    if work.validation_path:
        return Validation.load(Path(work.validation_path), device)
    held_out = plan.held_out_data(dataset)
    if held_out is None:
        return None
    if spec.role == "drafter":
        return Awaited(Path(work.run_dir) / VALIDATION_FILE, validation_key(cfg, plan.held_out, plan.features),
                       cfg.trainer.val_every, device, cfg.pipeline.peer_timeout)
    return Validation.build(cfg, target, held_out, plan.features)


def _serve_validation(work: TrainWork, spec: WorkerSpec, plan: RunPlan, dataset, target) -> None:
    """The first target replica's part where no job computed the held-out packs: build them (every rank of
    the replica runs the same forwards) and save them for the drafter ranks (its leader)."""
    held_out = plan.held_out_data(dataset)
    if work.validation_path or held_out is None or spec.replica_of(spec.rank) != 0:
        return
    packs = Validation.build(work.cfg, target, held_out, plan.features)
    if spec.rank == spec.replicas[0][0]:
        packs.save(Path(work.run_dir) / VALIDATION_FILE, validation_key(work.cfg, plan.held_out, plan.features))


def _plan(work: TrainWork, spec: WorkerSpec, dataset, drafter_config) -> RunPlan:
    """The job's plan, or under torchrun the one every rank makes alike (the split and the steps are seeded)."""
    if work.plan is not None:
        return work.plan
    state = load_state(Path(work.resume_state_path)) if work.resume_state_path else None
    return RunPlan.make(work.cfg, dataset, drafter_config, len(spec.drafter_ranks) * work.cfg.optimizer.grad_accum,
                        state)


def _serve(work: TrainWork, spec: WorkerSpec, peers: Peers, session, tp_group) -> None:
    """A target rank: the target's features of its replica's share of the packs, to the drafter ranks."""
    cfg, device = work.cfg, torch.device(spec.device)
    if tp_group is not None:  # this rank's slices of the target only (models/sharded_loading.py)
        target = load_sharded_target(cfg.run.target, tp_group, device)
    else:
        target = load_target(cfg.run.target, device=device)
    use_experts(target.model, cfg.pipeline.target_experts)
    drafter_cfg = load_config(work.drafter_dir) if work.drafter_dir is not None else drafter_config(cfg, target)
    dataset = open_prepared(cfg, work.data_dir)
    plan = _plan(work, spec, dataset, drafter_cfg)
    _serve_validation(work, spec, plan, dataset, target)
    stream = plan.stream(cfg, dataset)
    # of the packs it serves
    cache = feature_cache(cfg, target, stream.tokens(), plan.features, share=len(spec.target_ranks))
    with target.compiled_layers(cfg.pipeline.compile_target):
        serve_features(spec, peers, target, plan.features, stream, plan.total_steps, depth=cfg.pipeline.queue_depth,
                       cache=cache, prof=session.stats.loop("target"), trace=session.trace)


def _train(work: TrainWork, spec: WorkerSpec, peers: Peers, session, group) -> DFlashDrafter:
    """A drafter rank ("drafter": features from the target ranks; "both": from its own target thread)."""
    cfg, device = work.cfg, torch.device(spec.device)
    # A drafter-only worker uses the target's embedding and LM head (and its last layers once, to
    # initialise the drafter): it reads only those where it can (a split target, an HF directory),
    # else a real target loads on the host and only those reach the GPU. Random targets are drawn
    # on the device, so that they equal the target workers' draw.
    head_only = spec.role == "drafter"
    on_host = head_only and not cfg.run.target.startswith("random:")
    target = drafter_side_target(cfg, device, fresh=work.drafter_dir is None, where="cpu" if on_host else device,
                                 head_only=head_only)
    if work.drafter_dir is not None:
        drafter = load_drafter(work.drafter_dir, dtype=torch.float32).to(device)
    else:  # seeded, so every drafter rank builds the same one (DDP also broadcasts rank 0's)
        drafter = make_drafter(cfg, target, None).to(device)
    dataset = open_prepared(cfg, work.data_dir)
    plan = _plan(work, spec, dataset, drafter.config)
    layer_ids = plan.features
    validate = _validation(work, spec, plan, dataset, target, device)  # a "both" rank's, before any layer is freed
    if head_only:
        target.keep_only_head(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # a random target's layers were allocated here first
    d_ranks = spec.drafter_ranks
    me = d_ranks.index(spec.rank)
    devices = len({d for _, d in spec.devices})  # the GPUs of the whole run: the records' mfu is over them all
    hooks = Hooks(prof=session.stats.loop("drafter"), trace=session.trace, stop_requested=peers.stop_requested,
                  heartbeat=lambda step: peers.stepped(spec.rank, step),
                  flops=flop_counter(cfg, target, drafter, layer_ids, devices), validate=validate)
    loop = train_loop(cfg, target, drafter, Path(work.run_dir), plan.total_steps,
                      dp=DataParallel(me, len(d_ranks), group if len(d_ranks) > 1 else None),
                      resume_state=load_state(Path(work.resume_state_path)) if work.resume_state_path else None,
                      progress=work.progress and me == 0, hooks=hooks, target_workers=len(spec.target_ranks),
                      checkpoints=work.checkpoints)
    stream = plan.stream(cfg, dataset, loop.stream_state)
    packs = drafter_packs(spec, stream, plan.total_steps)
    if spec.role == "both":
        cache = feature_cache(cfg, target, stream.tokens(), layer_ids, share=len(d_ranks))
        source = features_here(cfg, target, packs, layer_ids, cache, session.stats, session.trace)
    else:
        source = receive_features(spec, packs, layer_ids, target.hidden_size, cfg.data.token_budget, target.dtype,
                                  device, cfg.pipeline.queue_depth)
    try:
        with target.compiled_layers(cfg.pipeline.compile_target and spec.role == "both"):
            loop.train(source)
    finally:
        source.close()
    return drafter
