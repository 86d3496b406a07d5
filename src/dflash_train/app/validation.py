"""The validation estimate of tau (--val-conversations): the training objective, teacher-forced, on
conversations held out of training (data/validation_split.py).

The train record's `expected_tau` is measured on the packs being trained on, which after the first
epoch are packs seen before; on the H200 the 12-layer drafter's estimate ended at 3.86 while its
held-out HumanEval tau was 2.65 (docs/quality.md). The validation packs are never trained on, so
`val_expected_tau` against steps shows where training stops generalising. Their target features
are computed once, before training (a few packs), and kept on the target's device. In a
multi-process run a process that holds the whole target computes them and saves them
(VALIDATION_FILE in the run directory, removed when training ends): the job before it starts the
workers, or, where no process holds the whole target (--target-tp, torchrun), the first target
replica before it serves, with drafter ranks waiting for the file at their first validation
(Awaited). Every drafter worker validates, so the workers reach each validation step together
(its record all-reduces the training sums), and the first writes the values.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from dflash_train.data.packing import PackedBatch
from dflash_train.errors import UsageError
from dflash_train.files import write_atomic
from dflash_train.models.target import Target
from dflash_train.pipeline.features import target_features
from dflash_train.pipeline.stream import PackStream
from dflash_train.pipeline.target_features import FeatureSpec, TargetFeatures
from dflash_train.settings.tree import TrainConfig

KEYS = ("loss", "acc", "expected_tau")  # of the objective's record values
VALIDATION_FILE = "validation.pt"


class Every:
    """When a validation runs: every `every` steps, and at the last step."""

    every: int

    def due(self, step: int, last: int) -> bool:
        return step % self.every == 0 or step == last


class Validation(Every):
    def __init__(self, every: int, packs: list[tuple[PackedBatch, torch.Tensor, TargetFeatures]]) -> None:
        self.every, self.packs = every, packs  # (batch, target features) on one device; anchors on the host

    @classmethod
    def build(cls, cfg: TrainConfig, target: Target, held_out, features: FeatureSpec) -> Validation:
        """The held-out packs, one pass, with their target features, on the target's device."""
        stream = PackStream(held_out, cfg.data.token_budget, cfg.objective.num_anchors, cfg.run.seed, 1)
        loader, packs = stream.loader, []
        with torch.no_grad():
            while loader.state.epoch == 0 and loader.state.index < len(loader.lengths):  # one pass
                try:
                    pack = stream.next_step()[0]
                except UsageError:  # a whole pass without anchors: say so in the validation's terms
                    break
                if loader.state.epoch > 0:
                    break  # packs without anchors were skipped into the next pass
                feats = target_features(target, pack.batch, features)
                packs.append((pack.batch.to(target.device), pack.anchors, feats))
        if not packs:
            raise UsageError("--val-conversations: the held-out conversations have no two consecutive loss-masked "
                             "tokens to validate on; hold out more of them")
        return cls(cfg.trainer.val_every, packs)

    def save(self, path: Path, key: str = "") -> None:
        """The packs as host tensors (a worker process loads them with weights_only); `key`: the run's
        (validation_key), for readers that must tell this run's file from a killed run's."""
        packs = [(_host([b.input_ids, b.loss_mask, b.seq_ids, b.positions, b.labels]), anchors.cpu(),
                  _host([feats.hidden, feats.labels]))
                 for b, anchors, feats in self.packs]
        write_atomic(path, lambda f: torch.save({"every": self.every, "key": key, "packs": packs}, f))

    @classmethod
    def load(cls, path: Path, device: torch.device, key: str | None = None) -> Validation | None:
        """Memory-mapped, so the drafter workers reading it at once do not each hold it in host memory.
        None when `key` is given and the file is another run's."""
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if key is not None and saved.get("key") != key:
            return None
        return cls(saved["every"], [(PackedBatch(*batch).to(device), anchors, TargetFeatures(*feats).to(device))
                                    for batch, anchors, feats in saved["packs"]])

    def __call__(self, objective) -> dict[str, object]:
        """val_loss, val_acc and val_expected_tau over every held-out pack (one host sync, at the end), in the
        caller's grad mode (Trainer._validation_mode): the sums take the outputs' detached values only."""
        device = self.packs[0][0].input_ids.device
        sums = torch.zeros(objective.metric_width, device=device)
        for batch, anchors, feats in self.packs:
            objective.add_metrics(sums, objective(batch, anchors.to(device), feats.hidden, feats.labels), anchors)
        values, _ = objective.metrics(sums.cpu())  # host sync: once per validation
        return {f"val_{k}": values[k] for k in KEYS}


def validation_key(cfg: TrainConfig, held_out_indices, features: FeatureSpec) -> str:
    """What the held-out packs and their features depend on: equal keys, equal files (all seeded)."""
    parts = (cfg.run.target, cfg.run.seed, cfg.data.data, cfg.data.token_budget, cfg.objective.num_anchors,
             cfg.trainer.val_every, features, list(map(int, held_out_indices)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


class Awaited(Every):
    """A drafter rank's held-out packs when a target replica builds them: read at the first validation,
    waiting up to `timeout` seconds for the replica's file (it writes it before it serves, so it is
    there by then unless that replica is slower than the others)."""

    def __init__(self, path: Path, key: str, every: int, device: torch.device, timeout: float) -> None:
        self.path, self.key, self.every, self.device, self.timeout = path, key, every, device, timeout
        self._packs: Validation | None = None

    def __call__(self, objective) -> dict[str, object]:
        if self._packs is None:
            self._packs = self._wait()
        return self._packs(objective)

    def _wait(self) -> Validation:
        deadline = time.monotonic() + self.timeout
        while True:
            found = Validation.load(self.path, self.device, self.key) if self.path.is_file() else None
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.path}: the first target replica did not write this run's held-out packs "
                                   f"within --peer-timeout {self.timeout:g} s")
            time.sleep(0.5)


def _host(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [t.cpu() if t is not None else None for t in tensors]
