"""The target side: a batch producer feeding a bounded batch queue, and the TargetForwardLoop.

    BatchQueue          a thread iterating this worker's packs (host work: packing, anchors)
                        into a queue of bounded depth
    TargetForwardLoop   takes packs from it, runs the frozen target under inference mode on
                        its own CUDA stream, gathers the packed features and hands them off
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import torch

from dflash_train.data.packing import select
from dflash_train.models.target import Target
from dflash_train.pipeline.features import target_features
from dflash_train.pipeline.handoff import Features, LocalHandoff, P2PSender, PipelineStopped
from dflash_train.pipeline.stream import Pack
from dflash_train.pipeline.target_features import FeatureSpec, TargetFeatures
from dflash_train.profiling.device_time import DeviceTimer
from dflash_train.profiling.stats import NULL_LOOP
from dflash_train.profiling.tools import NO_TRACE

_DONE = object()


class BatchQueue:
    """The batch producer thread and its bounded queue; iterating yields packs until the stream ends."""

    def __init__(self, packs: Iterable[Pack], depth: int, prof=NULL_LOOP) -> None:
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.prof = prof
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(iter(packs),), name="batch-producer", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, packs: Iterator[Pack]) -> None:
        try:
            for pack in packs:
                if not self._put(pack):
                    return
            self._put(_DONE)
        except BaseException as e:  # handed to the consumer, which raises it with its traceback
            self._put(e)

    def __iter__(self) -> Iterator[Pack]:
        while True:
            t0 = time.perf_counter()
            try:
                item = self.q.get(timeout=0.1)
            except queue.Empty:  # the producer returns without a sentinel once closed: no wait for good
                if self.stop.is_set():
                    return
                continue
            self.prof.add("batch_queue_wait", time.perf_counter() - t0)
            self.prof.gauge("batch_queue_depth", self.q.qsize())
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.stop.set()


class FeatureCache:
    """Each sequence's target features, kept from its first pack on: later epochs skip the target.

    Costs FeatureSpec.token_bytes a token of the target's device memory (15.2M tokens x 5 x 576 x 2 B
    = 87 GB for SmolLM2 on the H200 recipe's data; target labels add 4 B a token). With `budget_bytes`
    it keeps sequences in the order they first come until the budget is spent; the rest are computed
    again each time they come, on their own (a batch of just them, data/packing.select), beside the
    cached ones of their pack. With `sized_after` packs and `size`, it keeps nothing for that many packs,
    then takes `size()` as its budget: a budget measured on the run's first steps (app/local.py).
    """

    def __init__(self, budget_bytes: int | None = None, sized_after: int = 0,
                 size: Callable[[], int | None] = lambda: None) -> None:
        self.parts: dict[int, TargetFeatures] = {}
        self.budget, self.bytes = budget_bytes, 0
        self.unsized, self.size = sized_after, size

    def features(self, pack: Pack, compute: Callable[[Pack], TargetFeatures]) -> TargetFeatures:
        if self.unsized:
            self.unsized -= 1
            if not self.unsized:
                self.budget = self.size()
            return compute(pack)
        ids = pack.sequence_ids
        missing = [k for k, i in enumerate(ids) if i not in self.parts]
        if not missing:
            return TargetFeatures.cat([self.parts[i] for i in ids])
        lengths = torch.bincount(pack.batch.seq_ids).tolist()  # the loader's host copy: no device sync
        if len(missing) == len(ids):
            feats = compute(pack)
            self._keep(ids, feats.split(lengths))
            return feats
        sub = compute(replace(pack, batch=select(pack.batch, missing)))
        fresh = dict(zip(missing, sub.split([lengths[k] for k in missing]), strict=True))
        self._keep([ids[k] for k in missing], list(fresh.values()))
        return TargetFeatures.cat([fresh[k] if k in fresh else self.parts[i] for k, i in enumerate(ids)])

    def _keep(self, ids: list[int], parts: list[TargetFeatures]) -> None:
        sizes = [p.nbytes for p in parts]
        room = sum(sizes) if self.budget is None else self.budget - self.bytes
        whole = sum(sizes) <= room  # all of them: views of the pack's tensor, which they use up
        for i, part, size in zip(ids, parts, sizes, strict=True):
            if size > room:
                continue  # over budget: computed again when it comes (another may still fit)
            self.parts[i] = part if whole else part.clone()  # a view alone would hold the whole pack
            self.bytes += size
            room -= size


class TargetForwardLoop:
    def __init__(self, target: Target, spec: FeatureSpec, prof=NULL_LOOP,
                 fault: Callable[[Pack], None] | None = None, trace=NO_TRACE,
                 cache: FeatureCache | None = None) -> None:
        self.target, self.spec, self.prof, self.trace, self.cache = target, spec, prof, trace, cache
        self.device = target.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # the target's busy seconds per pack: CUDA events on its stream, read once the GPU has passed
        # them (each pack reports the packs completed since the last one, so it lags a little)
        self.timer = DeviceTimer(self.device.type == "cuda")
        self.fault = fault or (lambda pack: None)

    def compute(self, pack: Pack) -> tuple[TargetFeatures, float]:
        """Features of one pack, on the target's stream, and the target's busy seconds."""
        self.fault(pack)
        self.trace.at(pack.step)
        start = self.timer.mark()
        feats = self.cache.features(pack, self._forward) if self.cache is not None else self._forward(pack)
        self.timer.add(start, self.timer.mark())
        busy = self.timer.ready_seconds()  # no host sync: only the events the GPU has passed
        self.prof.count("tokens", pack.num_tokens)
        return feats, busy

    def _forward(self, pack: Pack) -> TargetFeatures:
        return target_features(self.target, pack.batch, self.spec, self.prof)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def run_local(self, batches: BatchQueue, handoff: LocalHandoff) -> None:
        """Thread body (one process, shared device): features into the local hand-off queue."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread; a new one starts on cuda:0
        try:
            with self._on_stream():
                for pack in batches:
                    feats, busy = self.compute(pack)
                    event = None
                    if self.stream is not None:
                        event = torch.cuda.Event()
                        event.record(self.stream)
                    handoff.put(Features(pack, feats, busy), event, self.prof)
            handoff.close()  # the stream ended: a drafter that asks for more fails instead of waiting
        except PipelineStopped:
            pass
        except BaseException as e:  # the drafter loop re-raises it with this traceback
            handoff.fail(e)
        finally:
            batches.close()

    def run_follower(self, batches: BatchQueue, heartbeat: Callable[[], None]) -> None:
        """Process body of a tensor-parallel replica's other ranks: the leader's forwards, in its order (their
        collectives pair up), with nothing sent: the leader holds the same features."""
        try:
            with self._on_stream():
                for pack in batches:
                    self.compute(pack)
                    heartbeat()
        finally:
            batches.close()

    def run_p2p(self, batches: BatchQueue, sender: P2PSender, drafter_rank_of: Callable[[Pack], int],
                heartbeat: Callable[[], None]) -> None:
        """Process body: features to the drafter rank that trains on each pack."""
        try:
            with self._on_stream():
                for pack in batches:
                    feats, busy = self.compute(pack)
                    sender.send(pack.index, drafter_rank_of(pack), feats, busy, self.prof)
                    heartbeat()
                sender.flush()
        finally:
            batches.close()

