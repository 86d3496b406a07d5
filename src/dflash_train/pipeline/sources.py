"""Feature sources: where a training loop gets each pack's target features, behind one protocol.

    InlineSource    each step computes the pack's features, then trains on them, strictly one
                    after the other, on the training loop's thread (the naive loop)
    ThreadedSource  a TargetForwardLoop thread on its own CUDA stream feeds a bounded LocalHandoff
                    queue; target forwards run while the drafter computes, filling its gaps
    P2PReceiver     features computed by target processes, received point-to-point (handoff.py)

The first two keep each sequence's features after its first pack when given a FeatureCache, so
later epochs run only the drafter (or, with a cache that keeps only some, the target on the rest).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from dflash_train.models.target import Target
from dflash_train.pipeline.feature_cache import FeatureCache
from dflash_train.pipeline.handoff import Features, LocalHandoff, PipelineStopped
from dflash_train.pipeline.target_features import FeatureSpec
from dflash_train.pipeline.target_loop import BatchQueue, TargetForwardLoop
from dflash_train.profiling.stats import NULL_LOOP, NULL_PROFILE
from dflash_train.profiling.tools import NO_TRACE


class FeatureSource(Protocol):
    def get(self, prof=NULL_LOOP) -> Features:
        """The next pack and its features, on the training loop's device; prof times the wait."""

    def close(self) -> None:
        """Stop the threads or receives behind it (the run ended or failed)."""


class InlineSource:
    """Features computed on demand, on the drafter's thread (optionally cached per sequence)."""

    def __init__(self, target: Target, packs, spec: FeatureSpec, cache: FeatureCache | None, prof=NULL_LOOP) -> None:
        self.packs = iter(packs)
        self.pin = target.device.type == "cuda"
        self.loop = TargetForwardLoop(target, spec, prof, cache=cache)

    def get(self, prof=NULL_LOOP) -> Features:
        """The drafter's `hs_queue_wait` here is the whole inline target step: it waits for it."""
        t0 = time.perf_counter()
        pack = next(self.packs)
        if self.pin:  # BatchQueue's reason: the copies to the GPU then wait for nothing
            pack = pack.pinned()
        feats, busy = self.loop.compute(pack)
        prof.add("hs_queue_wait", time.perf_counter() - t0)
        return Features(pack, feats, busy)

    def close(self) -> None:
        pass


class ThreadedSource:
    """A TargetForwardLoop thread (own CUDA stream) -> LocalHandoff -> the drafter loop."""

    def __init__(self, target: Target, packs, spec: FeatureSpec, depth: int, prof=NULL_LOOP, trace=NO_TRACE,
                 cache: FeatureCache | None = None) -> None:
        self.handoff = LocalHandoff(depth)
        self.batches = BatchQueue(packs, depth, prof, pin=target.device.type == "cuda")
        self.loop = TargetForwardLoop(target, spec, prof, trace=trace, cache=cache)
        self.thread = threading.Thread(target=self.loop.run_local, args=(self.batches, self.handoff),
                                       name="target-forward", daemon=True)
        self.thread.start()

    def get(self, prof=NULL_LOOP) -> Features:
        try:
            return self.handoff.get(prof)
        except PipelineStopped:  # closed with nothing left: the target thread's packs ran out
            raise RuntimeError("the target thread's pack stream ended before the drafter's last step") from None

    def close(self) -> None:
        self.handoff.close()
        self.batches.close()
        self.thread.join(timeout=30)


def local_source(target: Target, packs, spec: FeatureSpec, *, overlap: bool, cache: FeatureCache | None, depth: int,
                 stats=NULL_PROFILE, trace=NO_TRACE) -> FeatureSource:
    """Features from this process's own target: a thread on its own CUDA stream (overlap), or inline."""
    if overlap:
        return ThreadedSource(target, packs, spec, depth, stats.loop("target"), trace, cache)
    return InlineSource(target, packs, spec, cache, stats.loop("target"))
