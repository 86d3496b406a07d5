"""`dflash-train` with a planted regression: the proof that `profile-report --compare` finds it.

    PLANT=sync:drafter.lm_head_loss  python3 benchmarks/planted.py train ARGS   # + torch.cuda.synchronize()
    PLANT=churn:drafter.lm_head_loss python3 benchmarks/planted.py train ARGS   # + allocator churn
    PLANT=sleep:target_forward:20    python3 benchmarks/planted.py train ARGS   # + 20 ms of host time
    TRAIN_SECONDS=40                 python3 benchmarks/planted.py train ARGS   # stop 40 s after the first step

The plant runs at the end of the named stage, inside its span (so the stage, and only it, is
slowed): `sync` waits for the whole device (the target thread's stream too); `churn` allocates
and frees a buffer whose size changes every call (32..88 MiB), then `torch.cuda.empty_cache()`
hands the cache back, so the next steps cudaMalloc/cudaFree again; `sleep:STAGE[:MS]` holds the
thread (default 20 ms). Without CUDA, `sync` becomes a 20 ms sleep (a CPU stand-in, said so on
stderr). Stages: see STAGES below.

No production code path is involved: a one-device `train` (no --target-devices) runs the target
and drafter loops as threads of this process (app/local.py), so the patches here reach both.
They do not reach the worker processes of --target-devices/--drafter-devices runs.

TRAIN_SECONDS ends training through the Trainer's stop hook once that many seconds have passed
since the first optimizer step finished (compilation excluded): the stop writes a checkpoint and
`train` exits 143 ("SIGTERM: stopped ..."); this script then exits 0. No export, no final eval.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable

import torch

STAGES: dict[str, tuple[str, str]] = {
    # stage -> (module, attribute): the function the stage's span wraps, patched where it is looked up
    "drafter.lm_head_loss": ("dflash_train.objective.objective", "weighted_block_loss"),
    "drafter.masks": ("dflash_train.objective.objective:DFlashObjective", "masks"),
    "target_forward": ("dflash_train.models.target:Target", "features"),
}


def _say(text: str) -> None:
    print(f"[planted] {text}", file=sys.stderr, flush=True)


def _action(kind: str, arg: str) -> Callable[[int], None]:
    """What runs after the stage's own work, given the call's index."""
    cuda = torch.cuda.is_available()
    if kind == "sync" and not cuda:
        _say("no CUDA: the planted sync is a 20 ms sleep instead")
        kind, arg = "sleep", "20"
    if kind == "sync":
        return lambda i: torch.cuda.synchronize()  # the planted host sync: waits for every stream of the device
    if kind == "sleep":
        seconds = float(arg or 20) / 1e3
        return lambda i: time.sleep(seconds)
    if kind == "churn":
        device = "cuda" if cuda else "cpu"  # the calling thread's current device

        def churn(i: int) -> None:
            buf = torch.empty((32 + 8 * (i % 8)) << 20, dtype=torch.uint8, device=device)  # a new size each call
            buf.zero_()
            del buf
            if cuda:
                torch.cuda.empty_cache()  # the cached segments go back to CUDA: the next mallocs are real
        return churn
    raise SystemExit(f"planted.py: PLANT kind {kind!r} is not sync, churn or sleep")


def plant(spec: str) -> None:
    """Patch the stage named in PLANT=kind:stage[:arg]."""
    kind, _, rest = spec.partition(":")
    stage, _, arg = rest.partition(":")
    if stage not in STAGES:
        raise SystemExit(f"planted.py: PLANT stage {stage!r} is not one of {', '.join(STAGES)}")
    where, attr = STAGES[stage]
    module, _, cls = where.partition(":")
    owner = getattr(__import__(module, fromlist=["_"]), cls) if cls else __import__(module, fromlist=["_"])
    action, original, calls = _action(kind, arg), getattr(owner, attr), [0]

    @functools.wraps(original)
    def planted(*args, **kwargs):
        out = original(*args, **kwargs)
        action(calls[0])
        calls[0] += 1
        return out

    setattr(owner, attr, planted)
    _say(f"{kind} planted in {stage} ({where}.{attr})")


def limit_training(seconds: float) -> dict:
    """Stop training `seconds` after the first optimizer step (the Trainer's own stop hook)."""
    from dflash_train.training.trainer import Trainer

    state: dict = {"start": None, "stopped_at": None}
    train = Trainer.train

    def limited(self, source):
        def stop(step: int) -> bool:
            if step >= 1 and state["start"] is None:
                state["start"] = time.perf_counter()  # the first step (compilation) is done
            if state["start"] is not None and time.perf_counter() - state["start"] >= seconds:
                state["stopped_at"] = step
                return True
            return False
        self.hooks.stop_requested = stop
        return train(self, source)

    Trainer.train = limited
    return state


def main(argv: list[str]) -> int:
    from dflash_train.cli import main as cli_main

    if os.environ.get("PLANT"):
        plant(os.environ["PLANT"])
    limit = limit_training(float(os.environ["TRAIN_SECONDS"])) if os.environ.get("TRAIN_SECONDS") else None
    try:
        return cli_main(argv)
    except SystemExit as e:
        if limit is None or limit["stopped_at"] is None or e.code != 143:
            raise
        _say(f"stopped at step {limit['stopped_at']}, TRAIN_SECONDS={os.environ['TRAIN_SECONDS']} after the first "
             "step (the 'SIGTERM' line above is this stop)")
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
