"""The target's decode forward over a preallocated KV cache, replayed as CUDA graphs.

Regeneration, the target-only baseline and DFlash verification are all decode loops: a
small model's step is a few hundred tiny kernels, so eager PyTorch spends its time launching
them (SmolLM2-135M: ~40 tokens/s at batch 1 on an H200). Here the step runs over a cache of
fixed shape, so on CUDA each (batch, query length, key length) shape is captured once as a
CUDA graph and then replayed as one launch. On CPU the same function runs eagerly: one path,
the same math.

The math is the HF model's own: its norms, MLPs, projections and rotary embedding modules are
called directly (no weight copies); only attention over the cache is ours. Cache row i, slot j
holds the K/V of position j of sequence i; a query at position p sees slots 0..p. A step
writes its K/V before attending, so slots past a row's end (padding written by a batched
prefill, or a rejected draft) are overwritten before any query can see them: "cropping" the
cache is just decoding from an earlier position.

Supported: the families of `architectures.FAMILIES` (llama, mistral, qwen2, qwen3 - SmolLM2
and the Qwen3 presets included - Gemma 3's text decoder, gpt_oss, qwen3_moe and qwen2_moe),
full-attention and sliding-window layers mixed as the config's `layer_types` say. Every layer's
cache holds every position; a sliding layer's mask keeps the last `sliding_window` of them (its
own included), prefill included. `supports(model)` says; callers fall back to HF. Graphs need a
forward without host reads (`architectures.capturable`: experts under transformers' "eager"
experts implementation have one); such a model runs its steps eagerly on CUDA too.

On CUDA in half precision, Triton kernels take the parts eager PyTorch runs as many small passes:
one-token attention of wide batches (`attention_kernel`), the attention of small batches' steps
(`span_attention`: eval's token, verify and draft steps at batch 1), and the elementwise chains with the
K/V writes (`fused_target`).
`StaticLM(model, attention_kernel=False, fused=False)` runs the PyTorch math instead: the CPU's path,
and the reference the kernels are tested and timed against.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.decode import (
    architectures,
    arrivals,
    attention_kernel,
    fused_target,
    graphs,
    linear_norm,
    linear_rope,
    span_attention,
)
from dflash_train.decode import packed as packed_weights
from dflash_train.decode.compiled_steps import CompiledSteps
from dflash_train.decode.graphs import GraphStore
from dflash_train.models.attention import attend, no_cudnn_sdpa, repeat_kv
from dflash_train.models.shapes import head_dim

KV_BUCKET = 128  # key-length granularity: one graph per bucket, at most 127 masked keys read per step
CACHE_BUCKET = 1024  # capacity granularity: nearby lengths share one cache (and its graphs)
_FOLD_ROWS = 64  # fold GQA groups into query rows (no K/V repeat) while group x query rows stay small


def supports(model: nn.Module) -> bool:
    """True when `model` is a decoder of a family StaticLM runs (architectures.family)."""
    return architectures.family(model) is not None


_INSTANCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def for_model(model: nn.Module) -> StaticLM | None:
    """The model's StaticLM (made once, so its graphs' memory pool is shared), or None if unsupported."""
    if not supports(model):
        return None
    if model not in _INSTANCES:
        _INSTANCES[model] = StaticLM(model)
    return _INSTANCES[model]


def use(lm: StaticLM) -> None:
    """Make `lm` what for_model returns for its model: an engine built with other options (the kernels
    off, to time them against the PyTorch math)."""
    _INSTANCES[lm.model] = lm


def release(model: nn.Module) -> None:
    """Forget the model's StaticLM (it holds the model: the weak-keyed registry alone never lets go)."""
    _INSTANCES.pop(model, None)


def bucket(n: int, size: int = KV_BUCKET) -> int:
    return -(-n // size) * size


@dataclass
class StaticCache(GraphStore):
    """K and V of every layer, [batch, kv_heads, capacity, head_dim] each, plus the graphs bound to them."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # a drafter's RoPE rows by slot (StaticDrafter._rope_rows)
    counters: torch.Tensor | None = None  # the split kernels' counts (decode/arrivals.py)

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @classmethod
    def allocate(cls, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> StaticCache:
        """Zeroed K/V for `layers` layers, capacity rounded up to CACHE_BUCKET slots."""
        shape = (batch, kv_heads, bucket(capacity, CACHE_BUCKET), head_dim)
        make = lambda: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        return cls(keys=[make() for _ in range(layers)], values=[make() for _ in range(layers)],
                   counters=arrivals.cache_counters(batch * kv_heads, device))

    def fits(self, batch: int, capacity: int, device: torch.device) -> bool:
        """Whether a decode of `batch` rows and `capacity` slots on `device` can reuse this cache (and its graphs)."""
        return self.batch == batch and self.capacity >= capacity and self.device == device


@dataclass
class Lengths:
    """One-token decode visibility as each row's key count [b] (slots 0..keys-1), of which a sliding
    layer sees the last `window`: no mask tensor."""

    keys: torch.Tensor
    window: int | None = None


@dataclass
class Spans:
    """Small-batch visibility as a span of slots per query, lo <= slot < hi, each [b, q] int32: what
    span_attention reads instead of a mask."""

    lo: torch.Tensor
    hi: torch.Tensor

    @classmethod
    def causal(cls, pos: torch.Tensor, window: int | None) -> Spans:
        """Queries at positions pos [b, q] seeing slots 0..pos, or the last `window` of them."""
        hi = (pos + 1).to(torch.int32)
        return cls(torch.zeros_like(hi) if window is None else (hi - window).clamp_(min=0), hi)


@dataclass
class Mask:
    """Which slots each query sees, visible [b, q, T], and `blocked` [b, 1, g*q, T]: its complement laid out as
    the folded decode path (cached_attention) reads it, for g query heads a K/V head; None where that path
    does not run. Made once a forward for every layer that shares it: per layer it cost two kernels (a
    negation and an expanding copy), each as long as its work at batch 1."""

    visible: torch.Tensor
    blocked: torch.Tensor | None = None

    @classmethod
    def of(cls, visible: torch.Tensor, groups: int, sinks: bool = False) -> Mask:
        b, n, t = visible.shape
        if groups * n > _FOLD_ROWS and not sinks:
            return cls(visible)
        return cls(visible, (~visible)[:, None, None].expand(b, 1, groups, n, t).reshape(b, 1, groups * n, t))


@dataclass
class StepOut:
    logits: torch.Tensor | None  # [b, q, V] (or [b, 1, V] for last_only)
    features: torch.Tensor | None  # [b, q, n * H] hidden states of the requested layers


class StaticLM(CompiledSteps):
    """Decode forwards of a frozen HF causal LM over a StaticCache (see module docstring)."""

    def __init__(self, model: nn.Module, graphs: bool | None = None, attention_kernel: bool = True,
                 fused: bool = True, packed: bool = True, tails: bool = True) -> None:
        if not supports(model):
            raise ValueError(f"StaticLM does not support {model.config.model_type} targets")
        self.model = model
        self.base = model.base_model
        cfg = model.config
        self.family = architectures.family(model)
        self.layer_types = architectures.layer_types(cfg)
        self.windows = architectures.windows(cfg)  # per layer type: positions seen back, None for all
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.n_layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads a K/V head
        self.head_dim = head_dim(cfg)
        self._graphs = graphs
        self._cache: StaticCache | None = None
        self._attention_kernel = attention_kernel
        # the elementwise chains as Triton kernels (fused_target.py) where they run: CUDA, half precision
        self._fused = fused and fused_target.applies(self.device, self.dtype)
        self._fused_mlp = fused_target.fusable_mlp(model)
        # with the fused kernels, a small model's q/k/v and gate/up as one GEMM each, as serving engines run them
        self._packed = (packed_weights.PackedWeights.of(self.base.layers, gate_up=self._fused_mlp)
                        if self._fused and packed else None)
        self._capturable = architectures.capturable(model)
        # with the fused kernels, a few rows' o_proj and down_proj each one kernel with the residual add and the
        # norm after them (linear_norm.layer_tail): Llama-style layers, no sandwich norms, no routed experts
        self._tails = (tails and self._fused and self._fused_mlp and not self.family.sandwich
                       and not self.family.routed_mlp and linear_norm.takes(self.base.layers))
        # with the tails, the packed q/k/v GEMM with the q/k norms (rounded as Llama's), RoPE and the K/V writes
        # (linear_rope)
        self._projected = (self._tails and self._packed is not None and self.family.norm == "llama"
                           and linear_rope.takes(self.base.layers, self.head_dim))

    @property
    def device(self) -> torch.device:
        return self.base.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.embed_tokens.weight.dtype

    @property
    def graphs(self) -> bool:
        return self.device.type == "cuda" and self._capturable if self._graphs is None else self._graphs

    # --- cache -----------------------------------------------------------------------------

    def cache_for(self, batch: int, capacity: int) -> StaticCache:
        """A cache for `batch` rows of at least `capacity` slots: the last one when it fits, with its graphs.

        Reusing it is safe without clearing: a query only sees slots its own steps have written
        (see the module docstring). Graphs are bound to a cache's buffers, so reuse is also what
        lets a decode loop replay the graphs captured by the previous one (eval: every prompt).
        """
        if self._cache is not None and self._cache.fits(batch, capacity, self.device):
            return self._cache
        self._cache = None  # free the old buffers (and graphs) before allocating the new ones
        self._cache = StaticCache.allocate(self.n_layers, batch, self.kv_heads, capacity, self.head_dim, self.dtype,
                                           self.device)
        return self._cache

    # --- the forward -----------------------------------------------------------------------

    @torch.no_grad()  # not inference_mode: torch.compile rejects its tensors
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, cache: StaticCache, kv_len: int, *,
                layers: tuple[int, ...] = (), logits: str = "all", last: torch.Tensor | None = None,
                prefill: bool = False) -> StepOut:
        """ids, pos [b, q]: write their K/V at slots pos, attend to slots < kv_len (masked to <= pos).

        logits: "all" (every query), "last" (the query at index `last` [b] of each row, or the
        final one), or "none". layers: feature layer ids (id L = output of layer L; L = N-1 is
        final-normed, as HF's hidden_states[N]). prefill: the caller's promise that every row's
        queries are positions 0..q-1, so the mask is plain causal over slots < q and attention
        runs as SDPA's causal kernel (flash on CUDA: no mask, no K/V copies per query head); sliding
        layers of a prefill longer than their window, and models with sink logits, keep the mask.
        """
        x = self.base.embed_tokens(ids)  # Gemma's embedding module scales by sqrt(hidden) itself
        ropes = self._ropes(x, pos)
        visible = self._visible(ids, pos, kv_len, prefill)
        fused = self._fused and not torch.compiler.is_compiling()  # a compiled step: inductor fuses them itself
        slots = pos.to(torch.int32) if fused else pos  # where the K/V go: converted once, not in every layer
        packed = self._packed if fused else None
        if packed is not None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            packed.refresh()  # an eager forward (every decode's prefill, a capture's warm-up): the model's weights
        feats = {}
        x, h = self._add_norm(x, None, self.base.layers[0].input_layernorm, fused)
        tail = fused and self._tails and linear_norm.applies(ids.numel(), cache.counters)
        for i, layer in enumerate(self.base.layers):
            kind = self.layer_types[i]
            a = self._attention(layer.self_attn, h, *ropes[kind], slots, visible[kind], cache, i, kv_len, fused,
                                packed and packed.layers[i], split=tail)
            last_layer = i + 1 == self.n_layers
            next_norm = self.base.norm if last_layer else self.base.layers[i + 1].input_layernorm
            gate_up = packed and packed.layers[i].gate_up
            if tail:
                x, h = linear_norm.layer_tail(x, a, layer, next_norm, cache.counters, gate_up, kind=self.family.norm)
            else:
                x, h = self._residuals(layer, x, a, next_norm, fused, gate_up)
            if i in layers:
                feats[i] = h if last_layer else x  # HF's hidden_states[N] is the final-normed output
        features = torch.cat([feats[i] for i in layers], dim=-1) if layers else None
        if logits == "none":
            return StepOut(None, features)
        if logits == "last":  # one row a sequence: at a 262K vocabulary a row's logits are 0.5 MB in bf16
            h = h[:, -1:] if last is None else h[torch.arange(h.shape[0], device=h.device), last][:, None]
        return StepOut(self._head(h), features)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module,
                  fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_target.add_rms_norm(x, delta, norm, fused, kind=self.family.norm)

    def _residuals(self, layer: nn.Module, x: torch.Tensor, a: torch.Tensor, next_norm: nn.Module,
                   fused: bool, gate_up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's two residual adds (attention output a, then the MLP's), each fused with the norm
        after it. Returns (x, next_norm(x)). Gemma norms each branch's output before its add too. gate_up:
        the MLP's packed gate and up weights, if any."""
        if self.family.sandwich:
            a = self._add_norm(a, None, layer.post_attention_layernorm, fused)[1]
            x, h = self._add_norm(x, a, layer.pre_feedforward_layernorm, fused)
        else:
            x, h = self._add_norm(x, a, layer.post_attention_layernorm, fused)
        m = fused_target.swiglu_mlp(layer.mlp, h, True, gate_up) if fused and self._fused_mlp else layer.mlp(h)
        if self.family.routed_mlp:
            m = m[0]  # (output, router scores)
        if self.family.sandwich:
            m = self._add_norm(m, None, layer.post_feedforward_layernorm, fused)[1]
        return self._add_norm(x, m, next_norm, fused)

    def _ropes(self, x: torch.Tensor, pos: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [b, q, d] per layer type: Gemma 3's local and global layers rotate with their own bases."""
        if self.family.rope_by_layer_type:
            return {kind: _whole(*self.base.rotary_emb(x, pos, kind), self.head_dim) for kind in self.windows}
        both = _whole(*self.base.rotary_emb(x, pos), self.head_dim)
        return dict.fromkeys(self.windows, both)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, tanh-capped where the config says (Gemma's final_logit_softcapping)."""
        out = self.model.lm_head(h)
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def _visible(self, ids: torch.Tensor, pos: torch.Tensor, kv_len: int,
                 prefill: bool) -> dict[str, Mask | Lengths | Spans | None]:
        """Per layer type, what each query may see: slots 0..pos, of which a sliding layer sees the last
        `window`. None: plain causal over a prefill's slots (no longer than the layer's window, and no
        sink logits, which SDPA does not take). A one-token step of a wide batch on CUDA gets each row's
        key count (Lengths: the decode kernel reads only those slots), a small batch's step each query's
        span (Spans: span_attention); others a Mask over [b, q, kv_len]."""
        compiling = torch.compiler.is_compiling()  # compiled: batched matmuls, which inductor fuses
        kernel = self._kernel_applies(ids) and not compiling
        spans = not kernel and not prefill and not compiling and self._spans_apply(ids)
        out = {}
        for kind, window in self.windows.items():
            if prefill and (window is None or ids.shape[1] <= window) and not self.family.sinks:
                out[kind] = None
            elif kernel:
                out[kind] = Lengths(pos[:, 0] + 1, window)
            elif spans:
                out[kind] = Spans.causal(pos, window)
            else:
                out[kind] = self._mask(pos, kv_len, window)
        return out

    def _mask(self, pos: torch.Tensor, kv_len: int, window: int | None) -> Mask:
        """Queries at pos [b, q] seeing slots 0..pos (the last `window` of them), over [b, q, kv_len]."""
        slots = torch.arange(kv_len, device=pos.device)[None, None, :]
        seen = slots <= pos[:, :, None]
        if window is not None:
            seen &= slots > pos[:, :, None] - window
        return Mask.of(seen, self.groups, self.family.sinks)

    def _kernel_applies(self, ids: torch.Tensor) -> bool:
        """Whether a step of these ids [b, q] attends through the Triton kernel (attention_kernel.applies)."""
        return self._attention_kernel and attention_kernel.applies(*ids.shape, self.kv_heads, self.head_dim,
                                                                   self.dtype, ids.device)

    def _spans_apply(self, ids: torch.Tensor) -> bool:
        """Whether a step of these ids [b, q] attends through span_attention (span_attention.applies)."""
        return self._attention_kernel and span_attention.applies(*ids.shape, self.kv_heads, self.groups,
                                                                 self.head_dim, self.dtype, ids.device)

    def _attention(self, attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                   visible: Mask | Lengths | Spans | None, cache: StaticCache, i: int, kv_len: int, fused: bool,
                   packed: packed_weights.PackedLayer | None, split: bool = False) -> torch.Tensor:
        """The layer's attention output through o_proj [b, q, H]; split (the split-reduction kernels run: a few
        rows, a cache with counts): o_proj's input, and the q/k/v projection through linear_rope where it runs."""
        b, q, _ = h.shape
        d = self.head_dim
        k_cache, v_cache = cache.keys[i], cache.values[i]
        # the new K/V first: a query at pos p sees slot p
        if split and self._projected:  # the q/k/v GEMM, norms, RoPE and the K/V writes as one kernel
            qs = linear_rope.project_rope_store(h, packed.qkv, attn.q_proj.out_features // d, cos, sin, k_cache,
                                                v_cache, pos, cache.counters, q_norm=getattr(attn, "q_norm", None),
                                                k_norm=getattr(attn, "k_norm", None))
            return self._attend(attn, qs, visible, cache, i, kv_len, project=False)
        qs, ks, vs = (t.view(b, q, -1, d) for t in packed_weights.projections(attn, h, packed))
        if hasattr(attn, "q_norm"):  # qwen3, gemma3: per-head RMSNorm before RoPE
            qs, ks = attn.q_norm(qs), attn.k_norm(ks)
        if fused:  # RoPE on q and k, and k and v into the cache, as one kernel
            fused_target.rope_store_(qs, ks, vs, cos, sin, k_cache, v_cache, pos)
            qs = qs.transpose(1, 2)  # [b, heads, q, d]
        else:
            qs, ks = fused_target.rope(qs, cos, sin), fused_target.rope(ks, cos, sin)
            qs, ks, vs = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)  # [b, heads, q, d]
            slots = pos[:, None, :, None].expand(b, self.kv_heads, q, d)
            k_cache.scatter_(2, slots, ks)
            v_cache.scatter_(2, slots, vs)
        return self._attend(attn, qs, visible, cache, i, kv_len, project=not split)

    def _attend(self, attn: nn.Module, qs: torch.Tensor, visible: Mask | Lengths | Spans | None, cache: StaticCache,
                i: int, kv_len: int, project: bool) -> torch.Tensor:
        """Queries qs [b, heads, q, d] attending to layer i's cache; through o_proj [b, q, H] where `project`, else
        o_proj's input."""
        b, _, q, _ = qs.shape
        k_cache, v_cache = cache.keys[i], cache.values[i]
        sinks = attn.sinks if self.family.sinks else None  # [heads]
        if visible is None:  # a prefill from position 0: causal over the q slots just written
            out = causal_attention(qs, k_cache[:, :, :q], v_cache[:, :, :q], attn.scaling)
        elif isinstance(visible, Lengths):  # each row up to its own length, whatever kv_len the batch has
            out = attention_kernel.decode_attention(qs, k_cache, v_cache, visible.keys, attn.scaling,
                                                    window=visible.window, sinks=sinks)
        elif isinstance(visible, Spans):  # writes [b, q, heads, d]: the reshape below copies nothing
            out = span_attention.span_attention(qs, k_cache, v_cache, visible.lo, visible.hi, attn.scaling, sinks,
                                                kv_len=kv_len, counters=cache.counters)
        else:
            out = cached_attention(qs, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], visible, attn.scaling,
                                   sinks)
        out = out.transpose(1, 2).reshape(b, q, -1)
        return attn.o_proj(out) if project else out

    # --- graphs ----------------------------------------------------------------------------

    def step(self, ids: torch.Tensor, pos: torch.Tensor, cache: StaticCache, kv_len: int, *,
             layers: tuple[int, ...] = (), logits: str = "all") -> StepOut:
        """`forward` for a decode-sized step; on CUDA a replay of the graph captured for this shape.

        The outputs of a replay live in the graph's buffers: the next replay of the same shape
        overwrites them, so read (or clone) them before stepping again.
        """
        kv_len = self.step_kv(cache, kv_len)
        if self._kernel_applies(ids):
            kv_len = cache.capacity  # the kernel reads each row's own slots: one graph per batch, not per bucket
        if not self.graphs:
            return self.step_forward(ids, pos, cache, kv_len, layers=layers, logits=logits)
        run = lambda i, p: self.step_forward(i, p, cache, kv_len, layers=layers, logits=logits)  # noqa: E731
        return graphs.replay(cache, (tuple(ids.shape), kv_len, layers, logits), run, ids, pos)


def _whole(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [b, q, head_dim]: gpt_oss's rotary module gives one half (its rotation pairs dims i and
    i + d/2 as rotate_half does, so repeating the half is the same math, roundings included)."""
    if cos.shape[-1] == head_dim:
        return cos, sin
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [b, H, n, d], k/v [b, Hkv, n, d] -> [b, H, n, d], query i seeing keys 0..i.

    A prefill's mask needs no tensor: the boolean one sent SDPA to its memory-efficient kernel,
    which computes every masked score too (2x the causal work) and, without grouped heads, needed
    K/V copied per query head first. Flash takes grouped heads as they are (enable_gqa), but only
    in half precision on CUDA: elsewhere (float32, CPU) a kernel that may not take them could fall
    back to the math one and its full score matrix, so K/V are copied per head there as before.
    Right padding is harmless: a real query never sees a later slot.
    """
    grouped = q.shape[1] != k.shape[1]
    if grouped and not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        (k, v), grouped = repeat_kv(q, k, v), False
    with no_cudnn_sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=grouped)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
                     scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, H, q, d], k/v [b, Hkv, T, d], mask over [b, q, T] (Mask.of with H // Hkv groups) -> [b, H, q, d].
    sinks [H]: a logit per head that joins each softmax's denominator and no key (gpt_oss): always the
    folded path below, whose scores SDPA would not expose."""
    b, H, n, d = q.shape
    hkv = k.shape[1]
    g = H // hkv
    if sinks is not None and mask.blocked is None:
        raise ValueError("cached_attention: sinks need the folded path: build the mask with Mask.of(..., sinks=True)")
    if mask.blocked is None:
        return attend(q, k, v, mask.visible[:, None], scale)  # prefill: compute-bound, the drafter's SDPA path
    # Decode: query head h uses K/V head h // g, so a group's g heads become g*n query rows against
    # one K/V head, and the work is reading K and V once (two batched GEMVs; measured faster than
    # SDPA's memory-efficient kernel with a mask on the H200). The scores stay in the cache's dtype,
    # as in HF's eager attention (the GEMV writes them so anyway): at 2,048 rows and 1K slots they are
    # 37 MB a layer in bf16, and the float32 copy, scale and mask passes they used to take moved
    # ~0.5 GB a layer beside K/V's 1.6 GB. The scale goes on the few query rows instead (exact for
    # head_dim 64: 1/8), the mask is one in-place pass, and softmax accumulates in float32 whatever
    # its dtype (so its bf16 output is HF's float32 softmax cast to bf16).
    # The scaled query rows land in the folded layout in one pass (q of several tokens is transposed: a
    # product, then a reshape, would be two). Compiled, inductor fuses the two itself (and out= would not
    # keep its layout there).
    if torch.compiler.is_compiling():
        qf = (q * scale).reshape(b, hkv, g * n, d)
    else:
        qf = torch.mul(q.view(b, hkv, g, n, d), scale, out=q.new_empty(b, hkv, g, n, d)).view(b, hkv, g * n, d)
    scores = torch.matmul(qf, k.transpose(-1, -2)).masked_fill_(mask.blocked, float("-inf"))
    if sinks is not None:
        return torch.matmul(_sink_softmax(scores, sinks, n), v).view(b, H, n, d)
    return torch.matmul(scores.softmax(-1), v).view(b, H, n, d)


def _sink_softmax(scores: torch.Tensor, sinks: torch.Tensor, n: int) -> torch.Tensor:
    """softmax over [scores, sink] without the sink's column, as gpt_oss's eager attention (less the max
    first: softmax subtracts it). scores [b, Hkv, g*n, T], rows head-major; sinks [H]."""
    b, hkv, rows, _ = scores.shape
    sink = sinks.to(scores.dtype).view(1, hkv, rows // n, 1, 1).expand(b, hkv, rows // n, n, 1).reshape(b, hkv, rows, 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
