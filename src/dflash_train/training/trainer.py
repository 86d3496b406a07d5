"""The Trainer: a training loop that knows nothing of the model it trains.

    trainer = Trainer(step_fn, optim, cfg, run_dir, total_steps, dp=..., resume_state=..., hooks=...)
    result = trainer.train(source)   # source.get(prof) -> a Sample (pipeline/sources.py has the sources)

It owns the optimizer, the schedule, data parallelism (DistributedDataParallel over the
training ranks; rank 0 writes metrics and checkpoints), metrics, checkpoints, graceful stop and
resume; resume restores every piece of state, so an interrupted run continues with exactly the
losses of an uninterrupted one. Two protocols are all it knows of the rest: a `FeatureSource`
hands it samples (computed inline, a local hand-off queue, or point-to-point from target
processes), and a `StepFunction` turns each into its objective's inputs and reads its metrics;
what is trained, its loss and its metrics are the step function's (training/drafter_loop.py
binds the DFlash objective).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from dflash_train.errors import UsageError
from dflash_train.pipeline.stream import StreamState
from dflash_train.profiling.flops import PackFlops
from dflash_train.profiling.stats import NULL_LOOP
from dflash_train.profiling.tools import NO_TRACE
from dflash_train.training.checkpoint import checkpoint_path, save_checkpoint
from dflash_train.training.config import OptimizerConfig, TrainerConfig
from dflash_train.training.metrics import MetricsLogger
from dflash_train.training.update import Update, cosine_schedule, make_optimizer


class DataUnit(Protocol):
    """What a sample was computed from, as far as the Trainer reads it (pipeline/stream.py's Pack is one)."""

    resume: StreamState  # the stream's position after it: where a checkpoint taken after it continues

    @property
    def num_tokens(self) -> int:
        """The target tokens it covers: the records' rates."""


class Sample(Protocol):
    """One micro-batch from a feature source (pipeline/handoff.py's Features is one)."""

    pack: DataUnit  # opaque beyond DataUnit: the step function and the FLOP counter read the rest
    target_busy_s: float | torch.Tensor  # seconds the target spent on it (a device scalar on NCCL)


class FeatureSource(Protocol):
    def get(self, prof=NULL_LOOP) -> Sample:
        """The next sample, on the training loop's device; prof times the wait."""

    def close(self) -> None:
        """Stop the threads or receives behind it (the run ended or failed)."""


class Objective(Protocol):
    """The module whose forward gives a micro-batch's loss (data parallel wraps it)."""

    model: nn.Module  # what is trained: the optimizer's parameters, the checkpoints' weights

    def __call__(self, *inputs: Any) -> Any:
        """The loss of one micro-batch: an output with a differentiable scalar `.loss`."""


class StepFunction(Protocol):
    """What is trained on each sample: the objective, its inputs and its metrics."""

    objective: Objective
    metric_width: int  # the width of its metric sums

    def inputs(self, sample: Sample, device: torch.device) -> tuple[Any, ...]:
        """The objective's forward arguments for `sample` on `device`, copies queued without a host sync."""

    def add_metrics(self, sums: torch.Tensor, out: Any, sample: Sample) -> None:
        """Adds one micro-batch's output to the device-side sums (no host sync)."""

    def metrics(self, sums: torch.Tensor) -> tuple[dict[str, Any], dict[str, float]]:
        """A log record's values (with "loss") from the host sums, and counts to report per second."""


@dataclass
class TrainResult:
    steps: int
    seconds: float
    last_record: dict[str, Any] | None


class GracefulStop(Exception):
    """A stop was requested (SIGINT/SIGTERM); the checkpoint of the current step is written."""


class Diverged(UsageError):
    """A non-finite loss, gradient norm or weight: the run stops without a checkpoint or an export.

    A UsageError: one line for the user, since the usual cause is a learning rate too high.
    """


@dataclass
class DataParallel:
    """This training worker's place among the D training workers."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the training ranks' process group (None: a single training worker)


@dataclass(kw_only=True)
class Hooks:
    """What watches and steers a run from outside; none of it changes what is trained."""

    prof: Any = NULL_LOOP  # this loop's profile view (profiling/stats.py)
    trace: Any = NO_TRACE  # the torch.profiler window (--torch-profile)
    stop_requested: Callable[[int], bool] = lambda step: False  # a coordinated stop (the launcher's)
    heartbeat: Callable[[int], None] = lambda step: None  # after every step (the launcher's liveness watch)
    # a PackFlops (profiling/flops.py): model FLOPs per pack, each record's mfu; None: no mfu
    flops: PackFlops | None = None
    # held-out packs (app/validation.py): .due(step, last_step), and called with the step function's objective,
    # the val_* values that join the next metrics record
    validate: Any = None


def _timed_allreduce(state, bucket):
    """DDP's all-reduce of one gradient bucket, timed from launch to completion as `grad_sync`.

    The buckets are reduced while backward still runs, so grad_sync overlaps `backward`.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    prof, group = state
    t0 = time.perf_counter()

    def done(fut):
        prof.add("grad_sync", time.perf_counter() - t0)
        return fut.value()

    return default_hooks.allreduce_hook(group, bucket).then(done)


class _Window:
    """Device-side sums between two log records (read back only when a record is written)."""

    def __init__(self, metric_width: int, device: torch.device) -> None:
        # [grad_norm, target_tokens, target_busy_s, model_flops, the objective's metric sums...]
        self.sums = torch.zeros(4 + metric_width, dtype=torch.float64, device=device)
        self.steps = 0
        self.wait_s = 0.0  # host seconds this rank waited for features
        self.flops = 0.0  # model FLOPs of this rank's packs, counted on the host (into sums[3] when read back)
        self.t0 = time.perf_counter()

    @property
    def objective_sums(self) -> torch.Tensor:
        return self.sums[4:]

    def add_micro(self, target_tokens: int, busy) -> None:
        self.sums[1] += target_tokens
        self.sums[2] += busy

    def add_step(self, grad_norm: torch.Tensor) -> None:
        self.sums[0] += grad_norm.double()
        self.steps += 1


class Trainer:
    def __init__(self, step_fn: StepFunction, optim: OptimizerConfig, cfg: TrainerConfig, run_dir: Path,
                 total_steps: int, *,
                 dp: DataParallel | None = None, resume_state: dict[str, Any] | None = None, progress: bool = True,
                 hooks: Hooks | None = None, target_workers: int = 1, checkpoints: bool = True) -> None:
        """target_workers: processes computing features (the record's target capacity counts them all);
        checkpoints=False writes no checkpoint files at all (the benchmark's runs)."""
        self.step_fn = step_fn
        objective = self.objective = step_fn.objective
        self.model = objective.model
        self.optim, self.cfg, self.run_dir, self.total_steps = optim, cfg, Path(run_dir), total_steps
        self.dp, self.hooks = dp or DataParallel(), hooks or Hooks()
        self.prof = self.hooks.prof
        self.progress, self.target_workers, self.checkpoints = progress, target_workers, checkpoints
        self.first_step_at: float | None = None  # perf_counter when the first optimizer step had finished
        self.device = next(self.model.parameters()).device
        self.optimizer = make_optimizer(self.model, optim.lr, optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           cosine_schedule(total_steps, optim.warmup_ratio))
        self.update = Update(objective, self.optimizer, self.scheduler, optim.grad_clip, self._parallel(objective),
                             self.prof)
        self.step, self.stream_state = 0, StreamState()
        self.checkpointed: int | None = None  # the step of the newest checkpoint on disk, when there is one
        if resume_state is not None:
            self._restore(resume_state)
            self.checkpointed = self.step

    def _parallel(self, objective: nn.Module) -> nn.Module:
        """The module that runs the forward: the objective, or its DDP wrapper with several training ranks."""
        if self.dp.size == 1:
            return objective
        from torch.nn.parallel import DistributedDataParallel as DDP

        # broadcast_buffers=False: the only buffers are the rotary tables, identical everywhere
        # (newer torch renames the flag and warns; the meaning we rely on is unchanged).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            module = DDP(objective, process_group=self.dp.group, broadcast_buffers=False, device_ids=None)
        if self.prof.enabled:
            module.register_comm_hook((self.prof, self.dp.group), _timed_allreduce)
        return module

    @property
    def writer(self) -> bool:
        return self.dp.rank == 0

    # --- state ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "stream": {k: int(v) for k, v in asdict(self.stream_state).items()},  # plain ints: weights_only loads
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.stream_state = StreamState(**state["stream"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])

    def checkpoint(self) -> Path | None:
        if not (self.writer and self.checkpoints):
            return None
        self._check_weights()  # the last good checkpoint stays `latest`
        with self.prof.span("checkpoint"), self._writing(f"checkpoint {checkpoint_path(self.run_dir, self.step)}"):
            path = save_checkpoint(self.run_dir, self.step, self.model, self.state(), self.cfg.keep_checkpoints)
        self.checkpointed = self.step
        return path

    @contextlib.contextmanager
    def _writing(self, what: str | None):
        """Stop with one line when a write of the run's outputs fails (a full disk, the run directory deleted):
        a traceback from deep in torch or a writer thread says less, and the last checkpoint stays usable.
        what: the output, for the message (None: the path the OSError names)."""
        try:
            yield
        except OSError as e:
            raise self._write_failed(what or os.fsdecode(e.filename or self.run_dir), e) from None

    def _write_failed(self, what: str, e: OSError) -> UsageError:
        if not self.run_dir.is_dir():  # writes into it would fail from now on, or make it anew
            return UsageError(f"--run-dir: {self.run_dir} disappeared during the run; stopped at step {self.step}")
        kept = (f"the checkpoint of step {self.checkpointed} is kept (--resume continues from it)"
                if self.checkpointed is not None else "no checkpoint was written before it")
        return UsageError(f"--run-dir: cannot write {what}: {e.strerror or e}; {kept}")

    def _diverged(self, what: str) -> Diverged:
        return Diverged(f"training diverged: {what}; lower --lr (now {self.optim.lr:g}) and start over with "
                        "--overwrite")

    def _check_record(self, record: dict[str, Any], steps: int) -> None:
        """Loss and gradient norm of the window just read back (no extra host sync)."""
        loss, grad_norm = record["loss"], record["grad_norm"]
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        stage = "loss (forward)" if not math.isfinite(loss) else "gradient norm (backward)"
        where = f"step {self.step}" if steps <= 1 else f"steps {self.step - steps + 1}..{self.step}"
        raise self._diverged(f"non-finite {stage} at {where} (loss {loss:g}, grad norm {grad_norm:g})")

    def _check_weights(self) -> None:
        """The last update can break the weights after the last logged loss; a host sync, once per checkpoint."""
        finite = torch.stack([torch.isfinite(p).all() for p in self.model.parameters()]).all()
        if not finite.item():  # host sync: checkpoints only
            raise self._diverged(f"non-finite weights after step {self.step}")

    # --- loop ----------------------------------------------------------------------------

    def train(self, source: FeatureSource) -> TrainResult:
        """Run steps until total_steps, taking `grad_accum` packs per step from `source`."""
        t_start = time.perf_counter()
        self.model.train()
        metrics = None
        if self.writer:
            with self._writing(None):
                metrics = MetricsLogger(self.run_dir, self.total_steps, self.step, self.progress)
        try:
            last = self._train(source, metrics)
        except BaseException:
            if metrics is not None:
                metrics.close(quiet=True)  # the run's own error is the one to report
            raise
        if metrics is not None:
            with self._writing(None):
                metrics.close()
        self.model.eval()
        return TrainResult(self.step, time.perf_counter() - t_start, last)

    def _train(self, source: FeatureSource, metrics: MetricsLogger | None) -> dict[str, Any] | None:
        """The steps, then the last checkpoint (also after a stop request); the last metrics record."""
        try:
            last = self._steps(source, metrics)
        except (KeyboardInterrupt, GracefulStop):
            self.checkpoint()
            raise
        self.checkpoint()  # raises Diverged if the last update broke the weights
        return last

    def _steps(self, source: FeatureSource, metrics: MetricsLogger | None) -> dict[str, Any] | None:
        """The optimizer steps up to total_steps; the last metrics record."""
        cfg = self.cfg
        window, last = _Window(self.step_fn.metric_width, self.device), None
        while self.step < self.total_steps:
            if self.hooks.stop_requested(self.step):
                raise GracefulStop()
            self.hooks.trace.at(self.step)
            self._step(source, window)
            self.hooks.heartbeat(self.step)
            if metrics is not None:
                metrics.advance()
            validated = self._validate(window)
            if validated or self.step % cfg.log_every == 0 or self.step == self.total_steps:
                with self.prof.span("metrics", sync="the logging step's read-back (sums.cpu())"):
                    last = {**self._record(window), **validated}  # a validation step writes a record of its own
                if metrics is not None:
                    with self._writing(None):
                        metrics.log(last)  # a non-finite record too: the diagnostic of the stop below
                self._check_record(last, window.steps)  # every training rank: the sums are all-reduced
                window = _Window(self.step_fn.metric_width, self.device)
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < self.total_steps:
                self.checkpoint()
        return last

    def _validate(self, window: _Window) -> dict[str, Any]:
        """The held-out values when a validation is due at this step, else {}."""
        if self.hooks.validate is None or not self.hooks.validate.due(self.step, self.total_steps):
            return {}
        t0 = time.perf_counter()
        # timed whole; the objective's and the layers' own spans inside would count as training's. In the
        # update's precision: outside its bf16 autocast the held-out forward ran in float32, other numbers than
        # training's, on compiled graphs of its own (the H200 record run of 2026-12-03: 13.9 s a validation)
        with self.prof.span("validate", sync="the held-out sums' read-back"), self.prof.muted(), \
                self._validation_mode(), self.update.autocast(self.device):
            values = self.hooks.validate(self.objective)
        window.t0 += time.perf_counter() - t0  # the record's rates are training's (less the step's queued tail)
        return values

    def _validation_mode(self) -> contextlib.AbstractContextManager[None]:
        """The grad mode of the validation's forwards: none (a subclass whose compiled graphs guard on it may
        validate in training's mode)."""
        return torch.no_grad()

    def _step(self, source: FeatureSource, window: _Window) -> None:
        """One optimizer step over `grad_accum` samples."""
        accum = self.optim.grad_accum
        for i in range(accum):
            t_get = time.perf_counter()
            sample = source.get(self.prof)
            window.wait_s += time.perf_counter() - t_get
            pack = sample.pack
            inputs = self.step_fn.inputs(sample, self.device)
            out = self.update.micro(*inputs, scale=1.0 / accum, sync=i == accum - 1)
            self.step_fn.add_metrics(window.objective_sums, out, sample)
            window.add_micro(pack.num_tokens, sample.target_busy_s)
            if self.hooks.flops is not None:
                window.flops += self.hooks.flops.of(pack)  # host arithmetic on the pack's host tensors
            self.prof.count("tokens", pack.num_tokens)
        window.add_step(self.update.step())
        self.stream_state = pack.resume
        self.step += 1
        if self.first_step_at is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # host sync: once, to time the first step honestly
            self.first_step_at = time.perf_counter()

    def _record(self, w: _Window) -> dict[str, Any]:
        """One metrics record; reading the window back is the only host sync of the loop."""
        sums = w.sums
        if self.hooks.flops is not None:
            sums[3] = w.flops  # a device write, no sync; the all-reduce then sums every rank's
        if self.dp.size > 1:
            sums = sums.clone()
            dist.all_reduce(sums, group=self.dp.group)  # every training rank's packs count
        sums = sums.cpu()  # host sync: only on logging steps
        dt = max(time.perf_counter() - w.t0, 1e-9)
        grad_norm, t_tok, busy, flops = sums[:4].tolist()
        values, counts = self.step_fn.metrics(sums[4:])
        record = {
            "step": self.step,
            "epoch": self.stream_state.epoch,
            **values,
            "lr": self.scheduler.get_last_lr()[0],
            # identical on every rank, summed by the all-reduce
            "grad_norm": grad_norm / max(w.steps, 1) / self.dp.size,
            "target_tokens_per_s": t_tok / dt,
            **{f"{k}_per_s": v / dt for k, v in counts.items()},
            # what the target role could deliver if it never waited: tokens per busy second, all target workers
            "target_capacity_tokens_per_s": t_tok / busy * self.target_workers if busy > 0 else None,
            # ... and the training role if it never waited for features (rank 0's waits stand for all ranks)
            "drafter_capacity_tokens_per_s": t_tok / (dt - w.wait_s) if dt > w.wait_s else None,
            "elapsed_s": dt,
        }
        if self.hooks.flops is not None:  # model FLOPs utilization of every device the run uses (CUDA only)
            record["mfu"] = flops / dt / self.hooks.flops.peak
        return record
