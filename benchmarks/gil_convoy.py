"""What Python work beside a loop of PyTorch calls costs that loop: alone, beside a thread, beside a process.

    python3 benchmarks/gil_convoy.py [--calls 2000] [--json OUT.json]

Every PyTorch call lets the GIL go while it dispatches and takes it back after. A thread beside it that runs
Python (a chat template's Jinja, lists of tokens) holds the GIL until its switch interval runs out
(sys.getswitchinterval(), 5 ms by default), so each call of the loop can wait that long. Regeneration's decode
loop is such a loop (a prefill launches ~10 kernels a layer eagerly); its host work (`data/regenerate.py`,
_HostWork) is such Python. The loop here is an in-place add on 16 floats; the Python beside it is a spinning
sum, on a thread at several switch intervals and in a spawned process (no shared GIL). CPU only, seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import sys
import threading
import time
from datetime import date

import torch


def per_call_us(calls: int) -> float:
    x = torch.zeros(16)
    t = time.perf_counter()
    for _ in range(calls):
        x.add_(1)
    return (time.perf_counter() - t) / calls * 1e6


def spin(stop, started) -> None:
    """Python that never lets the GIL go by itself (`started` set once it runs)."""
    started.set()
    s = 0
    while not stop.is_set():
        for i in range(1000):
            s += i


def beside(make, calls: int) -> float:
    """per_call_us while the worker `make()` gives (with its stop and started events) spins; timed once it has
    started (a spawned process imports this script and torch first), then stopped."""
    worker, stop, started = make()
    worker.start()
    started.wait()
    time.sleep(0.1)  # the worker spinning, not still between set() and its loop
    try:
        return per_call_us(calls)
    finally:
        stop.set()
        worker.join()


def _thread() -> tuple[threading.Thread, threading.Event, threading.Event]:
    stop, started = threading.Event(), threading.Event()
    return threading.Thread(target=spin, args=(stop, started)), stop, started


def _process():
    ctx = multiprocessing.get_context("spawn")
    stop, started = ctx.Event(), ctx.Event()
    return ctx.Process(target=spin, args=(stop, started)), stop, started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    default = sys.getswitchinterval()
    rows = {"alone": per_call_us(20 * args.calls)}
    for interval in (default, 1e-3, 2e-4):
        sys.setswitchinterval(interval)
        rows[f"beside a thread, switch interval {interval * 1e3:g} ms"] = beside(_thread, args.calls)
    sys.setswitchinterval(default)
    rows["beside a process"] = beside(_process, 20 * args.calls)
    for name, us in rows.items():
        print(f"{name:45s} {us:10.1f} us a call")
    if args.json:
        record = {"device": platform.processor() or platform.machine(), "cores": multiprocessing.cpu_count(),
                  "date": date.today().isoformat(), "torch": torch.__version__,
                  "command": "python3 benchmarks/gil_convoy.py " + " ".join(sys.argv[1:]), "us_per_call": rows}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
