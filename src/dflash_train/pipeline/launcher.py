"""Start one process per device and watch them: the multi-process pipeline on one host.

    dflash-train train --target-devices cuda:0 --drafter-devices cuda:1,cuda:2,cuda:3
    dflash-train train --target-devices cuda:0,cuda:1 --drafter-devices cuda:0,cuda:1   # a pipeline per GPU
    dflash-train train --target random:tiny --target-devices cpu --drafter-devices cpu,cpu   # gloo, for tests

The launcher stays out of the work: it starts the workers (spawn), each running the `main` it
was given for its rank (app/ranks.py for `train`), then waits on them.
    - a worker exits non-zero (an exception: its traceback is printed by the worker) or is
      killed from outside (kill -9): every other worker is terminated, the run exits 1;
    - no drafter step for --peer-timeout seconds: the stalest worker is named, the run exits 1;
    - SIGINT/SIGTERM: drafters stop together at a step a little ahead of the furthest one,
      rank 0 writes a checkpoint, the run exits 130/143 (a second signal kills at once).
Workers die with the launcher (PR_SET_PDEATHSIG), so nothing is left behind even if it is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash_train.devices import resolve_device
from dflash_train.errors import UsageError, say
from dflash_train.pipeline.worker import Peers, WorkerSpec, process_main


def parse_devices(text: str, flag: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise UsageError(f"{flag}: no device given")
    out = []
    for name in names:
        dev = resolve_device(name, flag)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", 0)
        if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
            raise UsageError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        out.append(str(dev))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    GRACE_S = 10.0  # after the drafters finish, how long target workers get to exit on their own

    def __init__(self, specs: list[WorkerSpec], main: Callable[[WorkerSpec, Peers], object]) -> None:
        """main(spec, peers): a rank's work, run in its own process (picklable: spawn sends it there)."""
        self.specs = specs
        ctx = mp.get_context("spawn")
        n = len(specs)
        self.peers = Peers(ctx.Array("d", [time.time()] * n, lock=False), ctx.Array("q", [0] * n, lock=False),
                           ctx.Value("q", -1, lock=False))
        self.heartbeats, self.steps, self.stop_at = self.peers.heartbeats, self.peers.steps, self.peers.stop_at
        self.procs = [ctx.Process(target=process_main, args=(main, s, self.peers), name=f"dflash-{s.role}-{s.rank}",
                                  daemon=False) for s in specs]
        self.signal_code: int | None = None

    def _on_signal(self, signum, frame) -> None:
        if self.signal_code is not None:  # second signal: stop now
            self.kill_all()
            os._exit(128 + signum)
        self.signal_code = 128 + signum
        furthest = max(self.steps[s.rank] for s in self.specs if s.trains)
        self.stop_at.value = furthest + 2  # every drafter is within a step of the furthest (lockstep all-reduce)
        say(f"{signal.Signals(signum).name}: stopping after step {furthest + 2} with a checkpoint "
            "(again to stop at once)")

    def kill_all(self) -> None:
        """SIGKILL: workers ignore SIGTERM (the launcher coordinates graceful stops)."""
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join()

    def run(self, peer_timeout: float) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for p in self.procs:
                p.start()
            return self._watch(peer_timeout)
        finally:
            self.kill_all()
            for s, h in old.items():
                signal.signal(s, h)

    def _report(self, failed: list[int]) -> None:
        """Name the likeliest cause first: a worker killed by a signal takes its peers down with it."""
        failed.sort(key=lambda i: (self.procs[i].exitcode >= 0, i))

        def how(i: int) -> str:
            code = self.procs[i].exitcode
            return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        stopped = self._stopped()
        if stopped is not None:  # the others failed waiting for it: name the cause first
            ended = ", ".join(f"{self.specs[i].describe(i)} {how(i)}" for i in failed)
            say(f"worker {self.specs[stopped].describe(stopped)} is stopped (SIGSTOP or a debugger); stopping the run "
                f"(ended waiting for it: {ended})")
            return
        first, rest = failed[0], failed[1:]
        also = f" (also ended: {', '.join(f'{self.specs[i].describe(i)} {how(i)}' for i in rest)})" if rest else ""
        say(f"worker {self.specs[first].describe(first)} {how(first)}; stopping the run{also}")

    def _stopped(self) -> int | None:
        """The index of a worker the OS has stopped (SIGSTOP, a debugger), if any."""
        return next((i for i, p in enumerate(self.procs) if p.exitcode is None and _process_state(p.pid) in ("T", "t")),
                    None)

    def _likely_culprit(self, now: float) -> str:
        """A worker the OS has stopped (SIGSTOP, a debugger) is the cause; else the stalest heartbeat,
        which can be a target blocked on a full queue rather than the worker that stopped."""
        stopped = self._stopped()
        if stopped is not None:
            return f"worker {self.specs[stopped].describe(stopped)} is stopped (SIGSTOP or a debugger)"
        stalest = min(range(len(self.specs)), key=lambda i: self.heartbeats[i])
        return (f"stalest worker: {self.specs[stalest].describe(stalest)}, "
                f"last seen {now - self.heartbeats[stalest]:.0f} s ago")

    def _watch(self, peer_timeout: float) -> int:
        drafters = [i for i, s in enumerate(self.specs) if s.trains]
        drafters_done_at = None
        while True:
            alive = [p for p in self.procs if p.exitcode is None]
            if alive:
                multiprocessing.connection.wait([p.sentinel for p in alive], timeout=1.0)
            failed = [i for i, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
            # A drafter exits 0 only after its last step (the end, or a stop with a checkpoint). From
            # then on a target worker that fails was sending to peers that are gone (seen after a
            # SIGTERM stop), so the run's outcome is the drafters'.
            finishing = any(self.procs[i].exitcode == 0 for i in drafters)
            if failed and not (finishing and not any(self.specs[i].trains for i in failed)):
                self._report(failed)
                return 1
            if all(self.procs[i].exitcode == 0 for i in drafters):
                if self.signal_code is not None:
                    return self.signal_code
                drafters_done_at = drafters_done_at or time.time()
                if all(p.exitcode is not None for p in self.procs) or time.time() - drafters_done_at > self.GRACE_S:
                    return 0
                continue
            now = time.time()
            newest = max(self.heartbeats[i] for i in drafters)
            if now - newest > peer_timeout:
                say(f"no drafter progress for {now - newest:.0f} s (--peer-timeout {peer_timeout:g}); "
                    f"{self._likely_culprit(now)}")
                return 1


def _process_state(pid: int | None) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T stopped, t traced, Z ...); None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, TypeError):
        return None
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0]  # the command name may hold spaces and ")"
