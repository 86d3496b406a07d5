"""Compile the drafter's training graphs ahead, in a process of its own, while the job prepares its data.

    handle = precompile.start(cfg, lambda: drafter_config, target)    # None unless --precompile on CUDA
    ... select, regenerate, prepare ...
    precompile.finish(handle)                                          # before the first training step

On a fresh machine the first training steps wait for torch.compile: the draft layers (forward and
backward, their attention traced in), the LM-head loss's kernels and the fused chains (50.7 s of the SmolLM2
recipe's first 50 steps on an H200, 2026-12-05). None of that depends on the data, only on the
drafter's and the target's shapes. The process started here runs the training step of a drafter of the
same config on synthetic packs under the same code, settings and autocast; what it compiles lands in
Inductor's and Triton's on-disk caches, which the job's own compiles then hit (a fresh process with warm
caches: 11.5 s instead of 44.8 s for that first window, 2026-12-02). It runs beside regeneration, which
keeps the GPU busy and the host mostly idle, and in a process of its own so that it takes neither the
job's GIL nor its random streams. A failure costs nothing but the time: the job compiles as before.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dflash_train.errors import say
from dflash_train.models.config import DFlashConfig
from dflash_train.models.target import Target
from dflash_train.profiling import compiles
from dflash_train.settings.tree import TrainConfig

SPEC_FILE = "precompile.json"
LOG_FILE = "precompile.log"
PACKS = 2  # steps run (run's docstring says why two)
WAIT_S = 600  # at most this long for the process once the data is ready; then the job compiles itself


@dataclasses.dataclass
class Handle:
    process: subprocess.Popen
    started: float
    folder: Path  # a temporary folder of its own: the spec and the process's output, removed at the end


def start(cfg: TrainConfig, drafter: Callable[[], DFlashConfig], target: Target) -> Handle | None:
    """The compiling process for the drafter `drafter()` configures, started; None where there is nothing to
    compile ahead (--precompile off, no --compile-drafter, not CUDA)."""
    if not (cfg.trainer.precompile and cfg.trainer.compile_drafter and target.device.type == "cuda"):
        return None
    folder = Path(tempfile.mkdtemp(prefix="dflash-precompile-"))
    (folder / SPEC_FILE).write_text(json.dumps(spec_of(cfg, drafter(), target)))
    with open(folder / LOG_FILE, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "dflash_train.app.precompile", str(folder / SPEC_FILE)],
                                   stdout=out, stderr=subprocess.STDOUT)
    return Handle(process, time.perf_counter(), folder)


def spec_of(cfg: TrainConfig, drafter: DFlashConfig, target: Target) -> dict:
    """What the compiling process needs to build the step the job will run (JSON): the drafter's config,
    the target's embedding and head shapes and dtype, the objective, the packs' sizes."""
    return {
        "drafter": drafter.to_reference_dict(),
        "vocab": int(target.embedding_weight.shape[0]), "hidden": target.hidden_size,
        "dtype": str(target.dtype).removeprefix("torch."), "head_bias": target.lm_head.bias is not None,
        "embed_scale": target.embed_scale, "objective": dataclasses.asdict(cfg.objective),
        "token_budget": cfg.data.token_budget, "max_length": cfg.data.max_length,
        "compile_masks": cfg.trainer.compile_masks, "compile_stack": cfg.trainer.compile_stack,
        "device": str(target.device), "seed": cfg.run.seed,
    }


def stop(handle: Handle | None) -> None:
    """End the process now (the job failed before it needed it)."""
    if handle is None:
        return
    if handle.process.poll() is None:
        handle.process.kill()
        handle.process.wait()
    shutil.rmtree(handle.folder, ignore_errors=True)


def finish(handle: Handle | None) -> None:
    """Wait for the process (its compiles are the ones the first step would do), at most WAIT_S."""
    if handle is None:
        return
    waiting = time.perf_counter()
    try:
        code = handle.process.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        code = None
    now = time.perf_counter()
    seconds, waited = now - handle.started, now - waiting
    lines = (handle.folder / LOG_FILE).read_text(errors="replace").strip().splitlines()
    if code == 0:
        # its own last line (the log also holds stderr: a warning at exit may come after it)
        said = next((line.removeprefix("precompile: ") for line in reversed(lines) if line.startswith("precompile: ")),
                    "")
        say(f"precompile: the drafter's training graphs compiled ahead ({seconds:.0f} s since it started, the job "
            f"waiting {waited:.0f} s of them{'; ' + said if said else ''})")
    else:
        say(f"precompile: {'timed out' if code is None else f'exit {code}'} ({lines[-1] if lines else 'no output'});"
            " the training compiles its graphs itself")
    stop(handle)


def run(spec: dict) -> float:
    """The training step (forward and backward) of a drafter of `spec`'s config on PACKS synthetic packs of
    varied sequences, compiled as training compiles it on CUDA (eager elsewhere: the same math, nothing
    compiled). Returns the last loss.

    The packs are shaped like the data's: sequences of many lengths, their anchors fewer than their tokens.
    torch.compile may specialize its first graph on sizes that happen to be equal: in a pack of equal sequences
    whose anchors times the block size equal their length (the SmolLM2 recipe's 128 x 8 = 1,024) FlexAttention's
    tile counts were, and packs of data compiled every layer graph again (counted on the CPU: test_precompile;
    the interval kernels did not, on an H100). The second pack is a guard: a graph the first specialized is
    compiled again in the general form the job's packs meet."""
    from dflash_train.models.factory import new_drafter
    from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig, feature_layer_ids
    from dflash_train.training.update import Update

    device = torch.device(spec["device"])
    dcfg = DFlashConfig.from_reference_dict(spec["drafter"])
    drafter = new_drafter(dcfg, spec["seed"], device).float()
    dtype, vocab, hidden = getattr(torch, spec["dtype"]), spec["vocab"], spec["hidden"]
    gen = torch.Generator(device).manual_seed(spec["seed"])
    embed = torch.randn(vocab, hidden, dtype=dtype, device=device, generator=gen)
    head = nn.Linear(hidden, vocab, bias=spec["head_bias"], device=device, dtype=dtype).requires_grad_(False)
    ocfg = ObjectiveConfig(**spec["objective"])
    objective = DFlashObjective(drafter, embed, head, ocfg, compiled_masks=spec["compile_masks"],
                                embed_scale=spec["embed_scale"])
    width = len(feature_layer_ids(dcfg, ocfg.kd_weight > 0)) * hidden
    update = Update(objective, torch.optim.SGD(drafter.parameters(), lr=0.0), None, grad_clip=0.0)
    with drafter.compiled_layers(device.type == "cuda", stack=spec["compile_stack"]):
        for pack in packs(spec):
            features = torch.randn(pack.batch.num_tokens, width, dtype=dtype, device=device, generator=gen)
            out = update.micro(pack.batch.to(device), pack.anchors.to(device), features)
    return float(out.loss.detach())


def packs(spec: dict) -> list:
    """run's PACKS packs: the job's token budget and anchors, sequences of varied lengths up to --max-length."""
    from dflash_train.data.synthetic import SyntheticSequences
    from dflash_train.pipeline.stream import PackStream

    seq_len = min(spec["max_length"], spec["token_budget"])
    data = SyntheticSequences.varied(4 * PACKS * max(1, spec["token_budget"] // seq_len), seq_len, spec["vocab"],
                                     spec["seed"])
    return list(PackStream(data, spec["token_budget"], spec["objective"]["num_anchors"], spec["seed"], 1).packs(PACKS))


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:])[0])
    t0 = time.perf_counter()
    loss = run(json.loads(path.read_text()))
    counts = compiles.snapshot()  # a cold machine's compiles miss; a warm one's hit (then precompile gained nothing)
    print(f"precompile: {PACKS} steps compiled and run in {time.perf_counter() - t0:.1f} s (loss {loss:.3f})"
          + compiles.cache_words(counts["cache_hits"], counts["cache_misses"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
