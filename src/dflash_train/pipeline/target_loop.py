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

import torch

from dflash_train.models.target import Target
from dflash_train.pipeline.feature_cache import FeatureCache
from dflash_train.pipeline.features import target_features
from dflash_train.pipeline.handoff import Features, LocalHandoff, P2PSender, PipelineStopped
from dflash_train.pipeline.stream import Pack
from dflash_train.pipeline.target_features import FeatureSpec, TargetFeatures
from dflash_train.profiling.device_time import DeviceTimer
from dflash_train.profiling.stats import NULL_LOOP
from dflash_train.profiling.tools import NO_TRACE

_DONE = object()


class BatchQueue:
    """The batch producer thread and its bounded queue; iterating yields packs until the stream ends.

    pin: the producer moves each pack into page-locked memory (a CUDA consumer), so that the consumer's copies
    to the GPU are queued behind its work instead of waiting for it: from pageable memory even a non_blocking
    copy synchronizes the stream, and the GPU then idles while the host launches the next step's first kernels.
    """

    def __init__(self, packs: Iterable[Pack], depth: int, prof=NULL_LOOP, pin: bool = False) -> None:
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.prof = prof
        self.pin = pin
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
                if not self._put(pack.pinned() if self.pin else pack):
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

