"""The worker processes of a multi-process run (started by pipeline/launcher.py, or by torchrun).

Ranks 0..T-1 are target workers, T..T+D-1 drafter workers. Every process joins one
torch.distributed group (NCCL on GPU, gloo on CPU); the drafter ranks also form the group
their DistributedDataParallel all-reduces over. The target ranks form replicas of `tp`
consecutive ranks each (--target-tp): a replica's ranks hold one target split by tensor
parallelism and run every forward together, and its first rank, the leader, sends the
features. Pack p is computed by replica p % R (R = T / tp) and trained on by drafter rank
T + p % D.

A "both" rank holds a whole pipeline on its device (the same device list given to both flags):
its target thread feeds its drafter through a local queue, and only gradients cross devices.

Here is what every rank shares: the process around its work (dies with the launcher, reports
its failure, exits without teardown), joining the group, and the feature plumbing of each role.
What a run's rank does with it (which models, which training loop) is the `main` the launcher
is given: app/ranks.py for `train`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from dflash_train.config import DEBUG_STACKS_ENV
from dflash_train.config import FAULT_ENV as FAULT
from dflash_train.errors import UsageError
from dflash_train.models.target import Target
from dflash_train.pipeline.feature_cache import FeatureCache
from dflash_train.pipeline.handoff import P2PReceiver, P2PSender
from dflash_train.pipeline.stream import Pack, PackStream
from dflash_train.pipeline.target_features import FeatureSpec
from dflash_train.pipeline.target_loop import BatchQueue, TargetForwardLoop
from dflash_train.profiling.stats import NULL_LOOP
from dflash_train.profiling.tools import NO_TRACE


@dataclass
class WorkerSpec:
    """Where one worker sits in the run."""

    rank: int
    role: str  # "target" | "drafter" | "both" (a target thread feeding this process's drafter)
    device: str
    devices: list[tuple[str, str]]  # (role, device) of every rank
    init_method: str  # torch.distributed rendezvous: tcp://127.0.0.1:PORT (launcher) or env:// (torchrun)
    peer_timeout: float  # seconds a peer may stay silent (--peer-timeout)
    tp: int = 1  # target ranks per replica (--target-tp)

    @property
    def trains(self) -> bool:
        return self.role != "target"

    @property
    def target_ranks(self) -> list[int]:
        return [r for r, (role, _) in enumerate(self.devices) if role != "drafter"]

    @property
    def drafter_ranks(self) -> list[int]:
        return [r for r, (role, _) in enumerate(self.devices) if role != "target"]

    @property
    def replicas(self) -> list[list[int]]:
        """The target ranks, `tp` consecutive ones to a replica."""
        ranks = self.target_ranks
        return [ranks[i:i + self.tp] for i in range(0, len(ranks), self.tp)]

    def replica_of(self, rank: int) -> int:
        return next(i for i, group in enumerate(self.replicas) if rank in group)

    def target_of(self, pack: Pack) -> int:
        """The rank that sends the pack's features: the leader of the replica that computes them."""
        return self.replicas[pack.index % len(self.replicas)][0]

    def drafter_of(self, pack: Pack) -> int:
        """The rank that trains on the pack."""
        return self.drafter_ranks[pack.index % len(self.drafter_ranks)]

    def describe(self, rank: int) -> str:
        role, device = self.devices[rank]
        return f"rank {rank} ({role}, {device})"


@dataclass
class Peers:
    """What the workers share with the launcher: their heartbeats and steps, and the coordinated stop."""

    heartbeats: Any  # per rank: time.time() of its last sign of life
    steps: Any  # per rank: its last finished step (training ranks)
    stop_at: Any  # .value: the step every training rank stops after (-1: no stop requested)

    @classmethod
    def unwatched(cls, n: int) -> Peers:
        """No launcher (torchrun): nobody reads the heartbeats, no stop comes; checkpoints are periodic."""
        return cls([0.0] * n, [0] * n, SimpleNamespace(value=-1))

    def beat(self, rank: int) -> None:
        self.heartbeats[rank] = time.time()

    def stepped(self, rank: int, step: int) -> None:
        self.beat(rank)
        self.steps[rank] = step

    def stop_requested(self, step: int) -> bool:
        return 0 <= self.stop_at.value <= step


def die_with_parent() -> None:
    """Linux: the kernel kills this process if the launcher dies (even by kill -9)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _fault(role: str):
    want_role, _, at = FAULT.raw().partition(":")
    if want_role != role or not at:
        return None
    at_pack = int(at)

    def check(pack: Pack) -> None:
        if pack.index == at_pack:
            raise RuntimeError(f"injected fault in the {role} loop at pack {at_pack} ({FAULT.name})")
    return check


def _with_fault(role: str, packs):
    """packs, raising at DFLASH_TRAIN_FAULT's pack when it names `role`."""
    fault = _fault(role)
    return packs if fault is None else (fault(p) or p for p in packs)


def process_main(main: Callable[[WorkerSpec, Peers], object], spec: WorkerSpec, peers: Peers) -> None:
    """A launched worker process: main(spec, peers), then exit with its outcome."""
    die_with_parent()
    # The launcher coordinates Ctrl-C and SIGTERM (a terminal or a scheduler signals the whole group);
    # it ends workers with SIGKILL when it has to.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if stacks_after := DEBUG_STACKS_ENV.seconds():
        import faulthandler
        faulthandler.dump_traceback_later(stacks_after, exit=False)
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # not tqdm's multiprocessing lock: os._exit below would leak its semaphore
    code = 0
    try:
        main(spec, peers)
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


@dataclass
class Groups:
    drafters: Any  # the drafter ranks' group (DistributedDataParallel)
    tp: Any  # this rank's target replica's group (tensor parallelism); None off a replica of several ranks


def join_group(spec: WorkerSpec, peers: Peers) -> Groups:
    """Join the run's process group on this rank's device; the drafter ranks' group and this rank's replica's."""
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # share the host's cores between the worker processes
        local = int(os.environ.get("LOCAL_WORLD_SIZE", len(spec.devices)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    peers.beat(spec.rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank, world_size=len(spec.devices),
                            timeout=timedelta(seconds=spec.peer_timeout))
    drafters = dist.new_group(spec.drafter_ranks)  # every rank takes part in creating every group
    if spec.tp == 1:
        return Groups(drafters, None)
    replicas = [dist.new_group(ranks) for ranks in spec.replicas]
    mine = [g for g, ranks in zip(replicas, spec.replicas, strict=True) if spec.rank in ranks]
    return Groups(drafters, mine[0] if mine else None)


def serve_features(spec: WorkerSpec, peers: Peers, target: Target, features: FeatureSpec, stream: PackStream,
                   total_steps: int, *, depth: int, cache: FeatureCache | None, prof=NULL_LOOP, trace=NO_TRACE) -> None:
    """A target rank: the features of its replica's share of the packs; the replica's leader sends each to the
    drafter rank that trains on it, the other ranks of the replica run the same forwards with it."""
    me, n = spec.replica_of(spec.rank), len(spec.replicas)
    packs = stream.packs(total_steps, keep=lambda p: p.index % n == me)
    loop = TargetForwardLoop(target, features, prof, _fault("target"), trace, cache)
    beat = functools.partial(peers.beat, spec.rank)
    if spec.rank != spec.replicas[me][0]:
        loop.run_follower(BatchQueue(packs, depth, prof), beat)
        return
    sender = P2PSender(depth, spec.peer_timeout, spec.describe)
    loop.run_p2p(BatchQueue(packs, depth, prof), sender, spec.drafter_of, beat)


def drafter_packs(spec: WorkerSpec, stream: PackStream, total_steps: int):
    """A drafter rank's share of the packs (DFLASH_TRAIN_FAULT fires here for its role)."""
    me, n = spec.drafter_ranks.index(spec.rank), len(spec.drafter_ranks)
    packs = _with_fault("drafter", stream.packs(total_steps, keep=lambda p: p.index % n == me))
    if spec.role == "both":
        packs = _with_fault("target", packs)  # fires where this process's target reads the pack
    return packs


def receive_features(spec: WorkerSpec, packs, features: FeatureSpec, hidden: int, budget: int, dtype: torch.dtype,
                     device: torch.device, depth: int) -> P2PReceiver:
    """A drafter-only rank's feature source: each pack's features from the target rank that computed them (its
    packs pinned for a CUDA drafter: target_loop.BatchQueue says why)."""
    if device.type == "cuda":
        packs = (p.pinned() for p in packs)
    return P2PReceiver(packs, spec.target_of, features.width(hidden), budget, dtype, device, depth, spec.peer_timeout,
                       spec.describe, labels=features.labels)
