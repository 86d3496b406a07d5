"""DFlash decoding at T=0 with the loop's state on the device: no host sync per step.

A batch-1 DFlash step is a draft, a verify and an acceptance test. When the host decides
acceptance, every step ends in a sync and the GPU idles while Python reads the tokens and
builds the next block. At T=0 acceptance is a comparison the device can make itself, so here
a whole step (draft, verify, accept, the next step's state) is one function of device
buffers, on CUDA one graph replay, and the host reads each step's record back one step late
(`host_reads`: the next step runs while it reads) to see whether the decode has ended. A step
past the end is wasted work, never wrong output: the host replays the records with the host
loop's own rules (the token limit, stop tokens) and ignores the rest.

The semantics are `speculative_generate`'s host loop, step for step: the same block widths
(a block cut short by the token limit is masked to its width, see `static_drafter`), the same
acceptance and the same per-step statistics.
"""

from __future__ import annotations

import weakref

import torch

from dflash_train.decode import graphs, greedy_accept, static_drafter, static_lm
from dflash_train.decode.graphs import GraphStore
from dflash_train.decode.greedy_accept import LoopState
from dflash_train.decode.host_reads import LaggedReads
from dflash_train.decode.static_lm import StaticCache, StaticLM, bucket
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.target import Target


class GreedyLoop:
    """The device half of a T=0 DFlash decode of one (target, drafter) pair; reused across prompts."""

    def __init__(self, lm: StaticLM, drafter: DFlashDrafter, engine: static_drafter.StaticDrafter) -> None:
        self.lm, self.drafter, self.engine = lm, drafter, engine
        self.B = drafter.block_size
        self.layers = tuple(drafter.config.target_layer_ids)
        self.device = lm.device
        self.caches: tuple[StaticCache, StaticCache] | None = None
        self.store = GraphStore()
        self.state: LoopState | None = None
        # the prompt's features, the drafter's meta for all but their last B, and the first step's key length
        self._prompt: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.lag: int | None = None  # steps queued past the one read next (None: host_reads' default)
        self.reads = LaggedReads(self.device, self.lag)  # the queued steps' records, on their way to the host
        self.queued = 0  # steps queued in this decode

    @torch.no_grad()
    def start(self, prompt: list[int], max_new_tokens: int) -> int:
        """Prefill the prompt; returns the first token (host sync: the caller's stop check)."""
        B, dev = self.B, self.device
        self.reads, self.queued = LaggedReads(dev, self.lag), 0
        self.engine.refresh()  # the step graphs read the drafter's packed weights
        lag = self.reads.lag
        self._allocate(len(prompt) + max_new_tokens + (lag + 2) * B, max_new_tokens + lag + 1)
        target_cache, _ = self.caches
        ids = torch.tensor([prompt], device=dev)
        pos = torch.arange(len(prompt), device=dev)[None]
        out = self.lm.forward(ids, pos, target_cache, bucket(len(prompt)), layers=self.layers, logits="last",
                              prefill=True)
        first = out.logits[0, -1].argmax()
        # The first step takes the prompt's last n features as a later step takes a verify's, so it
        # runs as one (a graph replay on CUDA); first_step puts the rest into the drafter's cache.
        L = len(prompt)
        n = min(L, B)
        self.state.commit_first(first, L, n, max_new_tokens)
        self._prompt = (out.features, torch.tensor([0, L - n, 1], device=dev), bucket(L + B))
        return int(first)  # host sync: the caller's stop check

    @torch.no_grad()
    def first_step(self) -> None:
        """The step on the prompt, as every later step runs (one graph replay on CUDA), after a drafter
        pass that writes all but the prompt's last B features into its context cache. That pass is
        the only part whose shape follows the prompt's length: its rows are padded to a KV_BUCKET
        multiple, so it too replays as a graph, one per bucket (2026-12-01, H200, 12-layer B=8
        drafter: the eager first step took 46 ms a prompt, as long as 9 graphed steps). The padded
        rows' K/V land in slots that a later step overwrites before any query sees them. No host sync."""
        feats, prefix_meta, kv_len = self._prompt
        self._prompt = None
        s, L = self.state, feats.shape[1]
        n = min(L, self.B)
        if L > n:  # a one-slot block: only the context's K/V are wanted, its draft is discarded
            rows, draft_cache = L - n, self.caches[1]
            if self.engine.compiled:  # a compiled forward would compile anew for each padded length
                self.engine.forward(feats[:, :rows], s.last[None], prefix_meta, draft_cache, bucket(rows + 1))
            else:
                ctx = feats.new_zeros(1, bucket(rows), feats.shape[2])
                ctx[:, :rows] = feats[:, :rows]
                self.engine.step(ctx, s.last[None], prefix_meta, draft_cache, bucket(rows + 1))
        s.feats[:, :n].copy_(feats[:, L - n:])
        self.queue(kv_len)

    def queue(self, kv_len: int) -> None:
        """Run one more step (keys below kv_len) and start its record's copy to the host; no host sync."""
        self.advance(1, kv_len)
        self.reads.post(self.state.records[self.queued])
        self.queued += 1

    def read(self) -> list[int]:
        """The oldest unread step's record: drafts accepted, then the target's B argmaxes."""
        return self.reads.read().tolist()  # host sync (host_reads): that step's, not the ones queued after it

    @torch.no_grad()
    def advance(self, steps: int, kv_len: int) -> None:
        """Run `steps` more full steps whose keys all lie below kv_len; no host sync."""
        if self.lm.compiled or self.engine.compiled:  # compiled steps run over the whole cache (one shape)
            kv_len = self.caches[0].capacity  # the drafter's cache has the same
        key = (kv_len, self.lm.compiled, self.engine.compiled)
        for _ in range(steps):
            if self.engine.graphs and self.lm.graphs:  # the target's verify is in the step: both must capture
                graphs.advance(self.store, key, lambda: self._step(kv_len), self.device)
            else:
                self._step(kv_len)

    @torch.no_grad()
    def _step(self, kv_len: int) -> None:
        """One full-width step on the last verify's features (state.feats), through the engines' compiled
        forwards when they have them."""
        s = self.state
        target_cache, draft_cache = self.caches
        draft = self.engine.step_forward(s.feats, s.block, s.meta, draft_cache, kv_len)  # [B-1, V]
        torch.argmax(draft, -1, out=s.verify[0, 1:])
        out = self.lm.step_forward(s.verify, s.pos, target_cache, kv_len, layers=self.layers, logits="all")
        greedy_accept.accept_(out.logits[0].argmax(-1), s)  # slot i's target token for position start+i+1
        s.feats.copy_(out.features)

    def _allocate(self, capacity: int, steps: int) -> None:
        """Caches and state for this decode; the last ones (and their graphs) when they fit."""
        if self.caches and self.caches[0].fits(1, capacity, self.device) and self.state.records.shape[0] >= steps:
            return
        self.caches = self.state = None
        self.store = GraphStore()  # graphs are bound to the buffers they were captured with
        lm, d, dev = self.lm, self.drafter, self.device
        n_feat = len(self.layers) * lm.model.config.hidden_size
        self.caches = (StaticCache.allocate(lm.n_layers, 1, lm.kv_heads, capacity, lm.head_dim, lm.dtype, dev),
                       StaticCache.allocate(len(d.layers), 1, self.engine.kv_heads, capacity, self.engine.head_dim,
                                            self.engine.dtype, dev))
        steps = bucket(steps, 256)
        long = dict(dtype=torch.long, device=dev)
        block = torch.full((1, self.B), self.drafter.mask_token_id, **long)
        self.state = LoopState(torch.zeros(1, self.B, n_feat, dtype=lm.dtype, device=dev), torch.zeros(3, **long),
                               block, torch.zeros(1, self.B, **long), torch.zeros(1, self.B, **long),
                               torch.zeros((), **long), torch.zeros((), **long), torch.zeros(1, **long),
                               torch.zeros(steps, 1 + self.B, **long))


_INSTANCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def for_pair(target: Target, drafter: DFlashDrafter) -> GreedyLoop | None:
    """The pair's GreedyLoop (made once, so its buffers and graphs are reused), or None off StaticLM targets."""
    lm = static_lm.for_model(target.model)
    if lm is None:
        return None
    loop = _INSTANCES.get(drafter)
    if loop is None or loop.lm is not lm:
        engine = static_drafter.for_drafter(drafter, target.model.get_input_embeddings(), target.lm_head)
        loop = _INSTANCES[drafter] = GreedyLoop(lm, drafter, engine)
    return loop


def release(drafter: DFlashDrafter) -> None:
    """Forget the drafter's decode loop and engine (and their caches and graphs), which hold it."""
    _INSTANCES.pop(drafter, None)
    static_drafter.release(drafter)
