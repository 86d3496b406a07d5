"""The drafter's decode step over a preallocated context cache, replayed as CUDA graphs.

One speculative decode step drafts a block: the drafter reads the target features of the
tokens the last verify committed (1..B of them), adds their K/V to its context cache and
attends from the B block slots to the whole cache. Eagerly, a 5-layer drafter's step is a few
hundred small kernels plus a growing `torch.cat` per layer; on an H200 that was about half of
a 7.5 ms DFlash step for SmolLM2-135M (docs/evaluation.md), so the drafter, not the method,
decided the speedup. Here every full-width step has one shape and replays as one graph.

Cache slot j holds the K/V of context position j. A step takes the verify's B feature rows
(rows past the committed count n belong to rejected slots) and writes all B at slots
ctx_start.., then writes the block's K/V at slots start = ctx_start + n..: the block's B slots
cover every rejected row, and the next step's context overwrites the block's. A block is
always written B wide; one cut short to q slots by the token limit masks its slots >= q, which
computes what a q-wide block would. A query sees slots < start + q (the committed context and
the block, non-causally); sliding-window layers also keep their causal window over positions,
as the eager drafter does. The math is the
eager drafter's own modules; only the cache and the masks are ours. On CUDA in half precision a layer is
10 kernels where eager it is ~16: q/k/v and gate/up are one GEMM each for small layers
(packed.PackedWeights); the q/k norms, RoPE and the K/V writes are one kernel (fused_drafter.norm_rope_store_:
the committed context rows and the block; the rejected rows, which the block would overwrite, are skipped);
attention is one kernel reading each query's span of slots, a program a key tile and a merge (span_attention);
each residual add runs fused with the norm after it (fused_target.add_rms_norm). Where the cache holds counts
(DFLASH_TRAIN_SPLIT_REDUCE, decode/arrivals.py) a layer is 5: the q/k/v GEMM with the norms, RoPE and the K/V
writes is one kernel (linear_rope), the merge runs in the tile kernel, o_proj with the residual add and the norm
after it is one kernel, and SwiGLU's product, down_proj, its add and the next layer's norm another (linear_norm:
the same math up to the order of the sums). The step's positions, slots,
spans and RoPE rows come from one kernel too (fused_drafter.step_setup). On CPU the same function runs
eagerly: one path, the same math.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from dflash_train.decode import fused_drafter, fused_target, graphs, linear_norm, linear_rope, span_attention
from dflash_train.decode import packed as packed_weights
from dflash_train.decode.compiled_steps import CompiledSteps
from dflash_train.decode.static_lm import Mask, Spans, StaticCache, cached_attention
from dflash_train.models.config import SLIDING_ATTENTION
from dflash_train.models.drafter import DFlashDrafter

_INSTANCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def for_drafter(drafter: DFlashDrafter, embed: nn.Module, head: nn.Module) -> StaticDrafter:
    """The drafter's StaticDrafter for this embedding and head (made once, so its graphs are reused)."""
    engine = _INSTANCES.get(drafter)
    if engine is None or engine.embed is not embed or engine.head is not head:
        engine = _INSTANCES[drafter] = StaticDrafter(drafter, embed, head)
    return engine


def release(drafter: DFlashDrafter) -> None:
    """Forget the drafter's StaticDrafter: the engine holds the drafter, so the weak-keyed registry
    alone never lets either go (nor the engine's caches and graphs)."""
    _INSTANCES.pop(drafter, None)


class StaticDrafter(CompiledSteps):
    """Batch-1 draft steps of a DFlashDrafter over a StaticCache (see the module docstring).

    `embed` and `head` are the target's input embedding and LM head: the step goes from block
    token ids to draft logits, so one graph holds the whole draft.
    """

    def __init__(self, drafter: DFlashDrafter, embed: nn.Module, head: nn.Module, graphs: bool | None = None,
                 fused: bool = True, spans: bool = True, packed: bool = True, tails: bool = True) -> None:
        self.drafter, self.embed, self.head = drafter, embed, head
        cfg = drafter.config
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        self.dtype = next(drafter.parameters()).dtype
        self.device = next(drafter.parameters()).device
        self._graphs = graphs
        # the layers' elementwise chains and the step's index work as Triton kernels where they run (each residual
        # add with its norm, SiLU x up, the q/k norms with RoPE and the K/V writes, step_setup): the drafter's own
        # math (its RMSNorm rounds as Llama's), up to the order of the norms' sums
        self._fused = fused and fused_target.applies(self.device, self.dtype)
        # on the fused path, small layers' q/k/v and gate/up as one GEMM each (packed.PackedWeights)
        self._packed = packed_weights.PackedWeights.of(drafter.layers) if self._fused and packed else None
        self._spans = spans  # on the fused path, attention through span_attention where it applies (else masks)
        # on the fused path, o_proj and down_proj each one kernel with the residual add and the norm after them
        # (linear_norm.layer_tail)
        self._tails = self._fused and tails and linear_norm.takes(drafter.layers)
        # with the tails, the packed q/k/v GEMM with the q/k norms, RoPE and the K/V writes (linear_rope)
        self._projected = self._tails and self._packed is not None and linear_rope.takes(drafter.layers, self.head_dim)
        self._cache: StaticCache | None = None

    @property
    def graphs(self) -> bool:
        return self.device.type == "cuda" if self._graphs is None else self._graphs

    def cache_for(self, capacity: int) -> StaticCache:
        """A cache of at least `capacity` slots: the last one when it fits (keeping its graphs).

        Reuse needs no clearing: a query sees only slots its own decode has written.
        """
        if self._cache is not None and self._cache.fits(1, capacity, self.device):
            return self._cache
        self._cache = None  # free the old buffers and graphs first
        self._cache = StaticCache.allocate(len(self.drafter.layers), 1, self.kv_heads, capacity, self.head_dim,
                                           self.dtype, self.device)
        return self._cache

    @torch.no_grad()  # not inference_mode: torch.compile rejects its tensors
    def forward(self, features: torch.Tensor, block: torch.Tensor, meta: torch.Tensor, cache: StaticCache,
                kv_len: int) -> torch.Tensor:
        """Draft logits [w-1, V] for block slots 1..w-1, of which the first q-1 are the draft.

        features [1, c, n*H]: target features of positions ctx_start..ctx_start+c-1, of which
        the first n are committed context; block [1, w]: the last committed token then mask
        tokens; meta [3] = (ctx_start, n, q), on the device so that one graph serves every step
        (q <= w: the block's width, its slots from q on are masked out).
        """
        d = self.drafter
        c, q = features.shape[1], block.shape[1]
        ctx = d.fuse(features.to(self.dtype))
        # through the target's embedding module, as training (Target.embed_scale), the eager drafter loop
        # (Target.embed) and the serving engines embed blocks: Gemma's module scales by sqrt(hidden)
        x = self.embed(block).to(self.dtype)
        if self._fused and not torch.compiler.is_compiling():  # compiled: inductor fuses the chains itself
            cos, sin, slots, masks = self._setup(meta, c, q, cache, kv_len)
            return self._logits(self._fused_layers(x, ctx, cos, sin, masks, slots, cache, kv_len))
        dev = features.device
        ctx_slots = meta[0] + torch.arange(c, device=dev)
        start = meta[0] + meta[1]  # position of block slot 0
        block_slots = start + torch.arange(q, device=dev)
        cos, sin = d.rotary(x, torch.cat([ctx_slots, block_slots])[None])
        masks = self._masks(block_slots, start + meta[2], kv_len)
        return self._logits(self._eager_layers(x, ctx, cos, sin, masks, ctx_slots, block_slots, cache, kv_len))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h[:, 1:].to(self.head.weight.dtype))[0]

    def _setup(self, meta: torch.Tensor, c: int, q: int, cache: StaticCache,
               kv_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Mask | Spans]]:
        """fused_drafter.step_setup for this step: (cos, sin, K/V slots, what each layer type's queries see: their
        spans where span_attention runs, else masks over those spans' slots)."""
        cfg = self.drafter.config
        window = cfg.sliding_window if SLIDING_ATTENTION in cfg.layer_types else None
        cos, sin, slots, lo, hi, sliding_lo, sliding_hi = fused_drafter.step_setup(meta, c, q, *self._rope_rows(cache),
                                                                                   window)
        if not self._spans_apply(q):  # the block's slots, and one past its q written ones
            return cos, sin, slots, self._masks(slots[0, c:], hi[:, :1], kv_len)
        masks = dict.fromkeys(cfg.layer_types, Spans(lo, hi))
        if window is not None:
            masks[SLIDING_ATTENTION] = Spans(sliding_lo, sliding_hi)
        return cos, sin, slots, masks

    def _rope_rows(self, cache: StaticCache) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [C, d] of positions 0..C-1 as the drafter's rotary module gives them (elementwise math: a
        position's row is the same whatever else it is computed with), made once a cache and kept with it, so
        that the graphs reading them live no longer than they do."""
        if cache.rope is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("StaticDrafter: a graph capture before any run on this cache (no RoPE rows yet)")
            positions = torch.arange(cache.capacity, device=self.device)[None]
            cos, sin = self.drafter.rotary(torch.empty(0, dtype=self.dtype, device=self.device), positions)
            cache.rope = (cos[0].contiguous(), sin[0].contiguous())
        return cache.rope

    def _fused_layers(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      masks: dict[str, Mask | Spans], slots: torch.Tensor, cache: StaticCache,
                      kv_len: int) -> torch.Tensor:
        """The layers through the fused kernels (CUDA, half precision): the K/V rows (the context, then the
        block's normed input) live in one buffer that the norms write into, so the projections read them with
        no concatenation; a layer's q/k/v and gate/up are one GEMM each where the weights are packed."""
        d, c = self.drafter, ctx.shape[1]
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.refresh()  # an eager call (or a capture's warm-up): its weights are the drafter's own
        rows = torch.cat([ctx, torch.empty_like(x)], dim=1)  # [1, c + q, H]
        x, h = fused_target.add_rms_norm(x, None, d.layers[0].input_layernorm, True, out_h=rows[:, c:])
        tails = self._tails and linear_norm.applies(x.shape[1], cache.counters)
        projected = self._projected and linear_norm.applies(rows.shape[1], cache.counters)
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            packed = self._packed and self._packed.layers[i]
            if projected:  # the q/k/v GEMM, norms, RoPE and the K/V writes as one kernel
                qs = linear_rope.project_rope_store(rows, packed.qkv, attn.q_proj.out_features // self.head_dim, cos,
                                                    sin, cache.keys[i], cache.values[i], slots, cache.counters,
                                                    queries=x.shape[1], q_norm=attn.q_norm, k_norm=attn.k_norm)
            else:
                qs, ks, vs = packed_weights.projections(attn, rows, packed)  # q of the context rows too: a few rows
                qs = fused_drafter.norm_rope_store_(qs[:, c:], ks, vs, attn.q_norm, attn.k_norm, cos, sin,
                                                    cache.keys[i], cache.values[i], slots)
            out = self._attend(qs, masks[layer.layer_type], cache, i, kv_len)
            last = i + 1 == len(d.layers)
            next_norm, next_h = (d.norm, None) if last else (d.layers[i + 1].input_layernorm, rows[:, c:])
            if tails:
                o = out.transpose(1, 2).reshape(*x.shape[:2], -1)  # span_attention's [b, q, heads, d]: no copy
                x, h = linear_norm.layer_tail(x, o, layer, next_norm, cache.counters, packed and packed.gate_up,
                                              out_h=next_h)
            else:
                x, h = fused_target.add_rms_norm(x, attn.out(out), layer.post_attention_layernorm, True)
                m = fused_target.swiglu_mlp(layer.mlp, h, True, packed and packed.gate_up)
                x, h = fused_target.add_rms_norm(x, m, next_norm, True, out_h=next_h)
        return h

    def _eager_layers(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      masks: dict[str, Mask | Spans], ctx_slots: torch.Tensor, block_slots: torch.Tensor,
                      cache: StaticCache, kv_len: int) -> torch.Tensor:
        """The layers as the drafter's own modules compute them (the CPU, float32, a compiled step)."""
        d, c = self.drafter, ctx.shape[1]
        h = d.layers[0].input_layernorm(x)
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            qs, ks, vs = attn.qkv(h, ctx, cos, sin)
            for buf, new in ((cache.keys[i], ks), (cache.values[i], vs)):
                buf.index_copy_(2, ctx_slots, new[:, :, :c])  # then the block over the rejected rows
                buf.index_copy_(2, block_slots, new[:, :, c:])
            out = self._attend(qs, masks[layer.layer_type], cache, i, kv_len)
            x = x + attn.out(out)
            h = layer.post_attention_layernorm(x)
            x = x + layer.mlp(h)
            h = (d.layers[i + 1].input_layernorm if i + 1 < len(d.layers) else d.norm)(x)
        return h

    def _attend(self, qs: torch.Tensor, seen: Mask | Spans, cache: StaticCache, i: int, kv_len: int) -> torch.Tensor:
        scale = self.head_dim**-0.5
        if isinstance(seen, Spans):  # writes [1, q, heads, d]: attn.out's reshape copies nothing
            return span_attention.span_attention(qs, cache.keys[i], cache.values[i], seen.lo, seen.hi, scale,
                                                 kv_len=kv_len, counters=cache.counters)
        return cached_attention(qs, cache.keys[i][:, :, :kv_len], cache.values[i][:, :, :kv_len], seen, scale)

    def refresh(self) -> None:
        """Bring the packed weights up to the drafter's own (cheap when they are): before replaying graphs
        that read them, as the drafter may have trained since they were copied."""
        if self._packed is not None:
            self._packed.refresh()

    def _masks(self, block_slots: torch.Tensor, end: torch.Tensor, kv_len: int) -> dict[str, Mask]:
        """Per layer type, over [1, w, kv_len]: which slots each block query sees (`end`: one past the block's
        q slots): the whole written context and block, or in a sliding layer the query's own slot and the
        window before it. (Where span_attention runs, step_setup gives the same as spans.)"""
        cfg = self.drafter.config
        slots = torch.arange(kv_len, device=block_slots.device)
        diff = block_slots[:, None] - slots[None, :]
        seen = slots[None, :] < end  # written by this decode: the context and the block's q slots
        visible = {t: seen.expand(len(block_slots), -1)[None] for t in set(cfg.layer_types)}
        if SLIDING_ATTENTION in visible:
            visible[SLIDING_ATTENTION] = ((diff >= 0) & (diff < cfg.sliding_window))[None]
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        return {t: Mask.of(v, groups) for t, v in visible.items()}

    def _spans_apply(self, queries: int) -> bool:
        """Whether the fused path's block of `queries` attends through span_attention (span_attention.applies)."""
        cfg = self.drafter.config
        groups = cfg.num_attention_heads // self.kv_heads
        return self._spans and span_attention.applies(1, queries, self.kv_heads, groups, self.head_dim, self.dtype,
                                                      self.device)

    def step(self, features: torch.Tensor, block: torch.Tensor, meta: torch.Tensor, cache: StaticCache,
             kv_len: int) -> torch.Tensor:
        """`forward`, on CUDA as a replay of the graph captured for this shape.

        The logits live in the graph's buffer: read them before the next step.
        """
        kv_len = self.step_kv(cache, kv_len)
        if not self.graphs:
            return self.step_forward(features, block, meta, cache, kv_len)
        self.refresh()  # a replay runs no forward, whose eager calls refresh themselves
        run = lambda f, b, m: self.step_forward(f, b, m, cache, kv_len)  # noqa: E731
        key = (tuple(features.shape), tuple(block.shape), kv_len)
        return graphs.replay(cache, key, run, features.to(self.dtype), block, meta)
