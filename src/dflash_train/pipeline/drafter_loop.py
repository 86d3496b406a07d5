"""The drafter side: DrafterTrainLoop takes packed features, runs forward, backward and the step.

It owns the optimizer, the schedule, metrics and checkpoints. Where features come from is a
`source` (computed inline, a local hand-off queue, or point-to-point from target processes);
with several drafter workers the objective runs under DistributedDataParallel and rank 0
writes metrics and checkpoints. Resume restores every piece of state, so an interrupted run
continues with exactly the losses of an uninterrupted one.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_train.errors import UsageError
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.objective.loss import expected_acceptance_length
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig, check_backend_device
from dflash_train.pipeline.stream import StreamState
from dflash_train.profiling.stats import NULL_LOOP
from dflash_train.profiling.tools import NO_TRACE
from dflash_train.training.checkpoint import save_checkpoint
from dflash_train.training.config import TrainConfig
from dflash_train.training.metrics import MetricsLogger
from dflash_train.training.step import DrafterUpdate, cosine_schedule, make_optimizer


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
    """This drafter worker's place among the D drafter workers."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the drafter ranks' process group (None: a single drafter worker)


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

    def __init__(self, block_size: int, device: torch.device) -> None:
        # [ce, w, grad_norm, target_tokens, block_tokens, target_busy_s, correct[B], labelled[B]]
        self.sums = torch.zeros(6 + 2 * block_size, dtype=torch.float64, device=device)
        self.B = block_size
        self.steps = 0
        self.wait_s = 0.0  # host seconds this rank waited for features
        self.t0 = time.perf_counter()

    def add_micro(self, out, target_tokens: int, block_tokens: int, busy) -> None:
        s, B = self.sums, self.B
        s[0] += out.weighted_ce_sum
        s[1] += out.weight_sum
        s[3] += target_tokens
        s[4] += block_tokens
        s[5] += busy
        s[6:6 + B] += out.correct
        s[6 + B:] += out.labelled

    def add_step(self, grad_norm: torch.Tensor) -> None:
        self.sums[2] += grad_norm.double()
        self.steps += 1


class DrafterTrainLoop:
    def __init__(self, cfg: TrainConfig, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head: torch.nn.Module,
                 run_dir: Path, total_steps: int, *, dp: DataParallel | None = None,
                 resume_state: dict[str, Any] | None = None, progress: bool = True, prof=NULL_LOOP,
                 stop_requested: Callable[[int], bool] = lambda step: False,
                 heartbeat: Callable[[int], None] = lambda step: None, target_workers: int = 1,
                 trace=NO_TRACE, checkpoints: bool = True) -> None:
        self.cfg, self.drafter, self.run_dir, self.total_steps = cfg, drafter, Path(run_dir), total_steps
        self.dp = dp or DataParallel()
        self.progress, self.prof, self.stop_requested, self.heartbeat = progress, prof, stop_requested, heartbeat
        self.target_workers, self.trace, self.checkpoints = target_workers, trace, checkpoints
        self.first_step_at: float | None = None  # perf_counter when the first optimizer step had finished
        self.device = next(drafter.parameters()).device
        check_backend_device(cfg.attention, self.device)
        obj_cfg = ObjectiveConfig(gamma=cfg.gamma, attention=cfg.attention,
                                  loss_chunk_rows=cfg.loss_chunk_rows, kd_weight=cfg.kd_weight)
        self.objective = DFlashObjective(drafter, embed_weight, lm_head, obj_cfg)
        drafter.profile = prof  # the drafter times its internals (fc, attention, MLP) into this loop's view
        module = self.objective
        if self.dp.size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # broadcast_buffers=False: the only buffers are the rotary tables, identical everywhere
            # (newer torch renames the flag and warns; the meaning we rely on is unchanged).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                module = DDP(self.objective, process_group=self.dp.group, broadcast_buffers=False, device_ids=None)
            if prof.enabled:
                module.register_comm_hook((prof, self.dp.group), _timed_allreduce)
        self.optimizer = make_optimizer(drafter, cfg.lr, cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, cosine_schedule(total_steps, cfg.warmup_ratio))
        self.update = DrafterUpdate(self.objective, self.optimizer, self.scheduler, cfg.grad_clip, module, prof)
        self.step, self.stream_state = 0, StreamState()
        if resume_state is not None:
            self._restore(resume_state)

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
        with self.prof.span("checkpoint"):
            return save_checkpoint(self.run_dir, self.step, self.drafter, self.state(), self.cfg.keep_checkpoints)

    def _diverged(self, what: str) -> Diverged:
        return Diverged(f"training diverged: {what}; lower --lr (now {self.cfg.lr:g}) and start over with --overwrite")

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
        finite = torch.stack([torch.isfinite(p).all() for p in self.drafter.parameters()]).all()
        if not finite.item():  # host sync: checkpoints only
            raise self._diverged(f"non-finite weights after step {self.step}")

    # --- loop ----------------------------------------------------------------------------

    def train(self, source) -> TrainResult:
        """Run steps until total_steps, taking `grad_accum` packs per step from `source`."""
        cfg, t_start = self.cfg, time.perf_counter()
        accum = cfg.grad_accum
        self.drafter.train()
        metrics = MetricsLogger(self.run_dir, self.total_steps, self.step, self.progress) if self.writer else None
        window, last = _Window(self.drafter.block_size, self.device), None
        try:
            while self.step < self.total_steps:
                if self.stop_requested(self.step):
                    raise GracefulStop()
                self.trace.at(self.step)
                for i in range(accum):
                    t_get = time.perf_counter()
                    item = source.get(self.prof)
                    window.wait_s += time.perf_counter() - t_get
                    pack = item.pack
                    batch, anchors = pack.batch.to(self.device), pack.anchors.to(self.device)
                    out = self.update.micro(batch, anchors, item.features, 1.0 / accum, sync=i == accum - 1)
                    window.add_micro(out, pack.num_tokens, pack.anchors.numel() * self.drafter.block_size,
                                     item.target_busy_s)
                    self.prof.count("tokens", pack.num_tokens)
                window.add_step(self.update.step())
                self.stream_state = pack.resume
                self.step += 1
                if self.first_step_at is None:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)  # host sync: once, to time the first step honestly
                    self.first_step_at = time.perf_counter()
                self.heartbeat(self.step)
                if metrics is not None:
                    metrics.advance()
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    with self.prof.span("metrics", sync="the logging step's read-back (sums.cpu())"):
                        last = self._record(window)
                    if metrics is not None:
                        metrics.log(last)  # a non-finite record too: the diagnostic of the stop below
                    self._check_record(last, window.steps)  # every drafter rank: the sums are all-reduced
                    window = _Window(self.drafter.block_size, self.device)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < self.total_steps:
                    self.checkpoint()
        except (KeyboardInterrupt, GracefulStop):
            self.checkpoint()
            if metrics is not None:
                metrics.close()
            raise
        except Diverged:
            if metrics is not None:
                metrics.close()
            raise
        try:
            self.checkpoint()  # raises Diverged if the last update broke the weights
        finally:
            if metrics is not None:
                metrics.close()
        self.drafter.eval()
        return TrainResult(self.step, time.perf_counter() - t_start, last)

    def _record(self, w: _Window) -> dict[str, Any]:
        """One metrics record; reading the window back is the only host sync of the loop."""
        sums = w.sums
        if self.dp.size > 1:
            sums = sums.clone()
            dist.all_reduce(sums, group=self.dp.group)  # every drafter rank's packs count
        sums = sums.cpu()  # host sync: only on logging steps
        dt = max(time.perf_counter() - w.t0, 1e-9)
        B = self.drafter.block_size
        ce, wsum, grad_norm, t_tok, b_tok, busy = sums[:6].tolist()
        correct, labelled = sums[6:6 + B], sums[6 + B:]
        acc = (correct / labelled.clamp_min(1)).tolist()
        return {
            "step": self.step,
            "epoch": self.stream_state.epoch,
            "loss": ce / max(wsum, 1e-8),
            "acc": [round(a, 4) for a in acc[1:]],
            "expected_tau": float(expected_acceptance_length(correct, labelled)),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm / max(w.steps, 1) / self.dp.size,  # identical on every rank, summed by the all-reduce
            "target_tokens_per_s": t_tok / dt,
            "block_tokens_per_s": b_tok / dt,
            # what the target role could deliver if it never waited: tokens per busy second, all target workers
            "target_capacity_tokens_per_s": t_tok / busy * self.target_workers if busy > 0 else None,
            # ... and the drafter role if it never waited for features (rank 0's waits stand for all ranks)
            "drafter_capacity_tokens_per_s": t_tok / (dt - w.wait_s) if dt > w.wait_s else None,
            "elapsed_s": dt,
        }
