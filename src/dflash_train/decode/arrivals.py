"""Split-K's "the last program to finish reduces", for the decode kernels that split a product over programs
(span_attention's key tiles, linear_norm's K slices): one launch where a second kernel merged the parts.

Each program stores its part, then counts itself in: a CTA barrier (every thread's stores first), then an
atomic add whose release publishes them. The program that completes the count sees every part (the atomic's
acquire), reduces them in a fixed order (so the result does not depend on which program came last) and zeroes
the count, so the counts need zeroing once, when allocated: a decode cache holds them (StaticCache.counters),
and the calls of one stream, which run one after another, share them. Two kernels sharing counts must never
overlap: not on two streams at once, nor through programmatic dependent launch. A count left above zero
(a launch aborted midway) would leave every later call unreduced.
"""

from __future__ import annotations

import torch

from dflash_train.config import SPLIT_REDUCE_ENV

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None

MIN_COUNTS = 256  # linear_norm's column tiles plus one, for widths up to its NORM_TILE (4,096)


def counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed counts for calls that need up to `n` of them (at least MIN_COUNTS)."""
    return torch.zeros(max(n, MIN_COUNTS), dtype=torch.int32, device=device)


def cache_counters(n: int, device: torch.device) -> torch.Tensor | None:
    """A decode cache's counts (`counters`) unless DFLASH_TRAIN_SPLIT_REDUCE=0 turns the last-program reductions
    off, else None: the split kernels then reduce through a kernel of their own, as without counts."""
    return counters(n, device) if SPLIT_REDUCE_ENV.flag(True) else None


if triton is not None:
    @triton.jit
    def last_to_arrive(count, arrivals):
        """Whether this program is the `arrivals`-th to count itself in at `count` (see the module docstring);
        the last one also zeroes the count for the next call."""
        tl.debug_barrier()
        last = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == arrivals - 1
        if last:
            tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
        return last
