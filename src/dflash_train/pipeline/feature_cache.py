"""The feature cache (--cache-features): each sequence's target features, kept from its first pack on, so
later epochs skip the target. On a GPU it is sized on the run's own memory and gives memory back when the
allocator runs short (app/local.py sizes it and reads the allocator)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from dflash_train.data.packing import select
from dflash_train.errors import say
from dflash_train.pipeline.stream import Pack
from dflash_train.pipeline.target_features import TargetFeatures

SHED = 0.10  # the share of its bytes the cache gives back each time the device runs short


class FeatureCache:
    """Costs FeatureSpec.token_bytes a token of the target's device memory (15.2M tokens x 5 x 576 x 2 B
    = 87 GB for SmolLM2 on the H200 recipe's data; target labels add 4 B a token). With `budget_bytes`
    it keeps sequences in the order they first come until the budget is spent; the rest are computed
    again each time they come, on their own (a batch of just them, data/packing.select), beside the
    cached ones of their pack.

    size, sized_after: keep `sized_after` packs without a budget, then take `size()` as the budget (one
    measured on the run's first steps), giving back at once what it holds beyond it. short: whether the
    device ran short of memory since the last call (the allocator had to free its cached blocks and
    retry); then the cache gives back SHED of its bytes, the sequences it kept first, and grows no more.
    release: hands the memory given back to the device (another stream's allocations can take it).
    """

    def __init__(self, budget_bytes: int | None = None, *, size: Callable[[], int | None] | None = None,
                 sized_after: int = 0, short: Callable[[], bool] = lambda: False,
                 release: Callable[[], None] = lambda: None) -> None:
        self.parts: dict[int, TargetFeatures] = {}  # in the order kept: the first go first
        self.budget, self.bytes = budget_bytes, 0
        self.size, self.short, self.release = size, short, release
        self.unsized = sized_after if size is not None else None  # packs still to keep before the budget

    def features(self, pack: Pack, compute: Callable[[Pack], TargetFeatures]) -> TargetFeatures:
        if self.unsized is not None:
            self._measure()
        elif self.short():
            self._shed()
        ids = pack.sequence_ids
        missing = [k for k, i in enumerate(ids) if i not in self.parts]
        if not missing:
            return TargetFeatures.cat([self.parts[i] for i in ids])
        lengths = pack.batch.seq_ids.bincount().tolist()  # the loader's host copy: no device sync
        if len(missing) == len(ids):
            feats = compute(pack)
            self._keep(ids, feats.split(lengths))
            return feats
        sub = compute(replace(pack, batch=select(pack.batch, missing)))
        fresh = dict(zip(missing, sub.split([lengths[k] for k in missing]), strict=True))
        self._keep([ids[k] for k in missing], list(fresh.values()))
        return TargetFeatures.cat([fresh[k] if k in fresh else self.parts[i] for k, i in enumerate(ids)])

    def _keep(self, ids: list[int], parts: list[TargetFeatures]) -> None:
        sizes = [p.nbytes for p in parts]
        room = sum(sizes) if self.budget is None else self.budget - self.bytes
        whole = sum(sizes) <= room  # all of them: views of the pack's tensor, which they use up
        for i, part, size in zip(ids, parts, sizes, strict=True):
            if size > room:
                continue  # over budget: computed again when it comes (another may still fit)
            self.parts[i] = part if whole else part.clone()  # a view alone would hold the whole pack
            self.bytes += size
            room -= size

    def _measure(self) -> None:
        """One more pack kept unbudgeted, or the budget taken now and what is over it given back."""
        if self.unsized:
            self.unsized -= 1
            return
        self.unsized = None
        self.budget = self.size()
        if self.budget is not None and self.bytes > self.budget:
            self._evict(self.budget)
        self.short()  # retries so far were the measured steps' (compile, first allocations), not a shortage

    def _evict(self, limit: float) -> None:
        """The first-kept sequences out until `limit` bytes are left: their packs' tensors (views of one pack
        go together) return to the allocator, then to the device."""
        while self.parts and self.bytes > limit:
            self.bytes -= self.parts.pop(next(iter(self.parts))).nbytes
        self.release()

    def _shed(self) -> None:
        before = self.bytes
        self._evict(before * (1 - SHED))
        self.budget = self.bytes
        say(f"--cache-features: the GPU ran short of memory; the feature cache gave back "
            f"{(before - self.bytes) / 1e9:.1f} GB, keeps {self.bytes / 1e9:.1f} GB and grows no more")
