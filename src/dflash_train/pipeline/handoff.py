"""Moving packed features from target loops to drafter loops.

    LocalHandoff   one process: a bounded queue between the target thread and the drafter loop.
                   On CUDA the target computes on its own stream; the drafter's stream waits on an
                   event recorded after the features were packed (no host sync).
    P2PSender      target process -> drafter processes: torch.distributed isend (gloo on CPU,
                   NCCL on GPU), at most `depth` sends in flight per target worker.
    P2PReceiver    drafter process: irecv posted ahead into a ring of pre-allocated buffers
                   sized by the token budget, at most `depth` in flight.

Each pack is two messages: its hidden states, then a small int32 side message of the pack's meta
data [pack index, target busy seconds] (two float64, 16 bytes) followed by the target's labels
when the features carry them (4 bytes a token, next to the hidden states' layers x H x 2 in bf16).
The drafter checks the order on CPU and accounts the target role's busy time without asking.
A peer that sends or receives nothing for `timeout` seconds is reported by rank and device.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_train.pipeline.stream import Pack
from dflash_train.pipeline.target_features import LABEL_DTYPE, TargetFeatures
from dflash_train.profiling.stats import NULL_LOOP


class PeerTimeout(RuntimeError):
    pass


class PipelineStopped(Exception):
    """The other side of a local hand-off stopped (it failed or the run ended)."""


@dataclass
class Features:
    pack: Pack
    features: TargetFeatures  # on the drafter's device
    target_busy_s: float | torch.Tensor  # seconds the target spent on this pack (a device scalar on NCCL)


# --- one process ----------------------------------------------------------------------------


class LocalHandoff:
    """Bounded queue of Features between threads; a failure on either side reaches the other."""

    _POLL = 0.1  # seconds between checks of the stop flag while blocked

    def __init__(self, depth: int) -> None:
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.closed = threading.Event()
        self.error: BaseException | None = None

    def put(self, item: Features, event: torch.cuda.Event | None, prof=NULL_LOOP) -> None:
        t0 = time.perf_counter()
        while True:
            if self.closed.is_set():
                raise PipelineStopped()
            try:
                self.q.put((item, event), timeout=self._POLL)
                break
            except queue.Full:
                continue
        prof.add("hs_queue_full_wait", time.perf_counter() - t0)
        prof.gauge("hs_queue_depth", self.q.qsize())

    def get(self, prof=NULL_LOOP) -> Features:
        t0 = time.perf_counter()
        while True:
            if self.error is not None:
                raise self.error
            try:
                item, event = self.q.get(timeout=self._POLL)
                break
            except queue.Empty:
                if self.closed.is_set() and self.q.empty():
                    raise PipelineStopped() from self.error
        prof.add("hs_queue_wait", time.perf_counter() - t0)
        prof.gauge("hs_queue_depth", self.q.qsize())
        if event is not None:
            # The drafter's stream waits for the target stream's packing; the features' memory
            # was allocated on the target stream, so tell the allocator it is used here too.
            torch.cuda.current_stream().wait_event(event)
            item.features.record_stream(torch.cuda.current_stream())
        return item

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.closed.set()

    def close(self) -> None:
        self.closed.set()


# --- between processes ------------------------------------------------------------------------


def _wait(work, timeout: float, what: str) -> None:
    """Block the host until `work` completed, or fail naming the peer after `timeout` seconds."""
    stuck = PeerTimeout(f"{what}: nothing for {timeout:.0f} s (--peer-timeout); that worker is stuck or gone")
    if dist.get_backend() == "gloo":
        # gloo's send/recv works only report completion through wait(), which takes a timeout.
        try:
            work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            if "imeout" in str(e) or "imed out" in str(e):
                raise stuck from None
            raise
        return
    deadline = time.monotonic() + timeout  # NCCL: poll the work's CUDA event, then order the stream
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise stuck
        time.sleep(0.0002)
    work.wait()


META_WORDS = 4  # int32 words of the side message's meta data: [pack index, busy seconds] as two float64


def side_message(pack_index: int, busy_s: float | torch.Tensor, labels: torch.Tensor | None,
                 device: torch.device) -> torch.Tensor:
    """int32 [META_WORDS + S]: the meta data's float64 pair viewed as int32 words, then the labels if any."""
    # Filled on the device by kernels: a host tensor copied over would sync (pageable memory).
    side = torch.empty(META_WORDS + (0 if labels is None else len(labels)), dtype=LABEL_DTYPE, device=device)
    meta = side[:META_WORDS].view(torch.float64)
    meta[0] = float(pack_index)
    meta[1] = busy_s
    if labels is not None:
        side[META_WORDS:] = labels
    return side


class P2PSender:
    def __init__(self, depth: int, timeout: float, describe) -> None:
        self.depth, self.timeout, self.describe = depth, timeout, describe
        self.inflight: collections.deque = collections.deque()

    def send(self, pack_index: int, dst: int, features: TargetFeatures, busy_s: float | torch.Tensor,
             prof=NULL_LOOP) -> None:
        t0 = time.perf_counter()
        while len(self.inflight) >= self.depth:  # the bound: wait for the oldest send to be received
            w_dst, works, _ = self.inflight[0]
            for w in works:
                _wait(w, self.timeout, f"sending features to {self.describe(w_dst)}")
            self.inflight.popleft()
        prof.add("hs_queue_full_wait", time.perf_counter() - t0)
        with prof.span("handoff"):
            hidden = features.hidden.contiguous()
            side = side_message(pack_index, busy_s, features.labels, hidden.device)
            works = [dist.isend(hidden, dst), dist.isend(side, dst)]
        self.inflight.append((dst, works, (hidden, side)))  # keep tensors alive until sent
        prof.gauge("hs_queue_depth", len(self.inflight))

    def flush(self) -> None:
        while self.inflight:
            dst, works, _ = self.inflight.popleft()
            for w in works:
                _wait(w, self.timeout, f"sending features to {self.describe(dst)}")


class P2PReceiver:
    """Receives the features of `packs` (this drafter's, in order) from their target ranks.

    width: the hidden states' columns; labels: whether the target's labels come with them."""

    def __init__(self, packs, source_of, width: int, budget: int, dtype: torch.dtype, device: torch.device,
                 depth: int, timeout: float, describe, labels: bool = False) -> None:
        self.packs, self.source_of, self.timeout, self.describe = iter(packs), source_of, timeout, describe
        self.labels = labels
        # depth buffers in flight + one held by the step that is using it
        self.buffers = [torch.empty(budget, width, dtype=dtype, device=device) for _ in range(depth + 1)]
        side = META_WORDS + (budget if labels else 0)
        self.sides = [torch.zeros(side, dtype=LABEL_DTYPE, device=device) for _ in range(depth + 1)]
        self.pending: collections.deque = collections.deque()
        self.held: list[int] = []
        self.check_order = device.type == "cpu"
        self.slots = list(range(depth + 1))
        self.depth = depth
        self._post()

    def _post(self) -> None:
        while len(self.pending) < self.depth and self.slots:
            pack = next(self.packs, None)
            if pack is None:
                return
            slot = self.slots.pop()
            src = self.source_of(pack)
            buf = self.buffers[slot][: pack.num_tokens]
            side = self.sides[slot][: META_WORDS + (pack.num_tokens if self.labels else 0)]
            works = [dist.irecv(buf, src), dist.irecv(side, src)]
            self.pending.append((pack, slot, src, works))

    def get(self, prof=NULL_LOOP) -> Features:
        """The next pack's features; the buffers stay valid until release()."""
        self.release()
        if not self.pending:
            raise StopIteration
        prof.gauge("hs_queue_depth", len(self.pending))  # receives in flight (gloo cannot tell which arrived)
        pack, slot, src, works = self.pending.popleft()
        t0 = time.perf_counter()
        for w in works:
            _wait(w, self.timeout, f"receiving features from {self.describe(src)}")
        prof.add("hs_queue_wait", time.perf_counter() - t0)
        meta = self.sides[slot][:META_WORDS].view(torch.float64)
        if self.check_order and int(meta[0]) != pack.index:
            raise RuntimeError(f"pack order mismatch: expected pack {pack.index} from {self.describe(src)}, "
                               f"got {int(meta[0])}")
        self.held.append(slot)
        busy = float(meta[1]) if self.check_order else meta[1].clone()
        n = pack.num_tokens
        labels = self.sides[slot][META_WORDS:META_WORDS + n] if self.labels else None
        return Features(pack, TargetFeatures(self.buffers[slot][:n], labels), busy)

    def release(self) -> None:
        """The step is done with the buffers it got: post receives into them."""
        self.slots.extend(self.held)
        self.held.clear()
        self._post()

    def close(self) -> None:
        pass  # receives still posted end with the process group
