"""The batch producer's data: a deterministic stream of packs, grouped into optimizer steps.

Every worker of a run (target or drafter, any process) iterates the same stream and picks
its share, so only the target's features ever cross between processes: a drafter knows each
pack's tokens, loss mask and anchors by computing them itself.

    pack p of the run goes to drafter rank p % D and is computed by target rank p % T;
    step s consumes packs s*P .. s*P + P - 1, P = D * grad_accum.

A pack's anchors come from the objective (objective/anchors.py: seeded by the pack's index,
so they do not depend on which worker samples them or on resume). Packs without any anchor
(no two consecutive assistant tokens) are skipped and do not take a pack index.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from dflash_train.data.packing import LoaderState, PackedBatch, PackedLoader
from dflash_train.errors import UsageError
from dflash_train.objective.anchors import pack_anchors


@dataclass
class StreamState:
    """Where the next step's packs start: the loader's position and the next pack index."""

    epoch: int = 0
    index: int = 0
    pack: int = 0


@dataclass
class Pack:
    index: int  # position in the run's stream of usable packs
    step: int
    batch: PackedBatch  # host tensors
    anchors: torch.Tensor  # [n] host, sorted indices into the packed row
    sequence_ids: list[int] = field(default_factory=list)
    resume: StreamState | None = None  # the state the step after this pack's step starts from

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens

    def pinned(self) -> Pack:
        """This pack with its tensors in page-locked memory (PackedBatch.pin_memory; CUDA only)."""
        return replace(self, batch=self.batch.pin_memory(), anchors=self.anchors.pin_memory())


class PackStream:
    def __init__(self, dataset, token_budget: int, num_anchors: int, seed: int, packs_per_step: int,
                 state: StreamState | None = None) -> None:
        state = state or StreamState()
        self.loader = PackedLoader(dataset, token_budget, seed, LoaderState(state.epoch, state.index))
        self.num_anchors, self.seed, self.packs_per_step = num_anchors, seed, packs_per_step
        self.next_pack = state.pack

    @property
    def state(self) -> StreamState:
        return StreamState(self.loader.state.epoch, self.loader.state.index, self.next_pack)

    def tokens(self) -> int:
        """Tokens in one epoch of the data (every pack of it, all ranks' together)."""
        return int(self.loader.lengths.sum())

    def steps_per_epoch(self) -> float:
        return self.loader.steps_in_epoch(0) / self.packs_per_step

    def _next_pack(self) -> tuple[PackedBatch, torch.Tensor, list[int]]:
        skipped = 0
        while True:
            batch, picked = self.loader.next()
            anchors = pack_anchors(batch, self.num_anchors, self.seed, self.next_pack)
            if anchors.numel():
                return batch, anchors, picked
            skipped += len(picked)
            if skipped > len(self.loader.lengths):  # a whole epoch without one anchor
                raise UsageError("no training sequence has two consecutive loss-masked (assistant) tokens, "
                                 "so there is nothing to learn: check --data and --max-length")

    def next_step(self) -> list[Pack]:
        """The packs of the next optimizer step, in pack order."""
        step = self.next_pack // self.packs_per_step
        packs = []
        for _ in range(self.packs_per_step):
            batch, anchors, picked = self._next_pack()
            packs.append(Pack(self.next_pack, step, batch, anchors, picked))
            self.next_pack += 1
        for pack in packs:  # every rank sees some pack of the step, so each knows where the next starts
            pack.resume = self.state
        return packs

    def packs(self, total_steps: int, keep=lambda p: True):
        """Packs (for which keep(pack) holds) up to the end of step total_steps - 1."""
        while self.next_pack < total_steps * self.packs_per_step:
            for pack in self.next_step():
                if keep(pack):
                    yield pack
