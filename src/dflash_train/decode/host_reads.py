"""Read a decode loop's small per-step results one step late, so the GPU never waits on the host.

A decode loop reads something back every step (a stop flag, a step's accepted drafts) to know
when to end. Reading step k's result as soon as it is queued drains the device: the host waits
for it, then launches step k+1 onto an idle GPU. Queueing step k+1 first and then waiting on an
event recorded after step k's copy keeps one step running while the host reads. The price is at
most `lag` steps run past the end, which the caller discards. Checking every 8th step instead
(the loops before 2026-12-02) also kept the GPU busy, but ran up to 7 steps past a stop token.
"""

from __future__ import annotations

from collections import deque

import torch

LAG = 1  # steps a CUDA loop queues past the one it reads next; on CPU reads are never late (0)


class LaggedReads:
    """Values posted by a loop's steps, read back in order, at most `lag` posts behind the newest."""

    def __init__(self, device: torch.device, lag: int | None = None) -> None:
        self.device = device
        self.lag = (LAG if device.type == "cuda" else 0) if lag is None else lag
        self._posted: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()

    def post(self, value: torch.Tensor) -> None:
        """Start copying `value`, a small result of work already queued, to the host. No host sync."""
        if self.device.type != "cuda":
            self._posted.append((value.clone(), None))
            return
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)  # on the current stream of value's device
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(value.device))  # that stream, even when another device is current
        self._posted.append((host, done))

    def due(self) -> bool:
        """Whether more than `lag` posts are unread: read one before queueing more work."""
        return len(self._posted) > self.lag

    def read(self) -> torch.Tensor:
        """The oldest unread value, on the host."""
        host, done = self._posted.popleft()
        if done is not None:
            done.synchronize()  # host sync: this value's step only, not the steps queued after it
        return host

    def __len__(self) -> int:
        return len(self._posted)
