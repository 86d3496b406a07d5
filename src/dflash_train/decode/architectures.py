"""What StaticLM needs to know of a decoder family beyond the modules it calls: one row per family.

StaticLM runs the HF model's own embedding, norms, projections, MLPs and rotary modules; the
families differ in how a layer wires them and in which positions a layer's attention sees:

- `sandwich`: Gemma's four norms a layer. The attention and MLP outputs are normed before their
  residual adds (post_attention_layernorm, post_feedforward_layernorm), and the MLP's input norm is
  pre_feedforward_layernorm. Llama-style layers norm only the inputs (input_layernorm before
  attention, post_attention_layernorm before the MLP).
- `norm`: the RMSNorm's rounding, which `fused_target`'s kernel reproduces: "llama"
  (weight * normed.to(dtype)), "gemma" ((1 + weight) * normed in float32, then the cast) or
  "float32" (weight * normed in float32, then the cast: gpt_oss).
- `rope_by_layer_type`: the rotary module takes the layer type (Gemma 3: local and global bases).
- `sinks`: each attention head adds a learned logit to its softmax's denominator (`attn.sinks`,
  gpt_oss), which no key carries.
- `routed_mlp`: the MLP returns (output, router scores) (gpt_oss's experts).
- `experts`: some layers' MLPs route each token to transformers' experts modules (gpt_oss; qwen3_moe
  and qwen2_moe, whose sparse blocks return the output alone, the router and qwen2_moe's shared
  expert inside the module's call). Their kernel decides `capturable`, below.

Windows: a layer of type "sliding_attention" sees the last `config.sliding_window` positions,
its own included (HF's `sliding_window_overlay`: key > query - window). Mistral with a
`sliding_window` and no `layer_types` slides in every layer, as HF's Mistral does; so does qwen3_moe
(no `layer_types` in its config) with `use_sliding_window`.

Not supported (callers fall back to HF's forward): families outside the table; attention-score
softcapping (Gemma 2); Gemma 3's bidirectional mode; RoPE types whose frequencies depend on the
sequence length (dynamic, longrope).

CUDA graphs: experts under transformers' "eager" experts implementation pick the tokens each expert
runs with a host read (`nonzero`), which a graph cannot capture; under "grouped_mm" and "batched_mm"
the routing stays on the device; under "dflash_grouped" (what the loaders' `auto` sets for bf16 on
CUDA, models/experts.py) too for bf16 weights on CUDA (elsewhere it loops over the experts on the
host). `capturable` says which; any other implementation (a hub kernel) is taken as not capturable,
since nothing here knows whether it reads the host. (Under torch.compile with weights other than
bf16, transformers' grouped_mm falls back to a loop that reads the expert offsets on the host:
compiled MoE steps want bf16.)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dflash_train.models import grouped_experts
from dflash_train.models.document_attention import FULL, SLIDING, attention_windows


@dataclass(frozen=True)
class Family:
    sandwich: bool = False
    norm: str = "llama"
    rope_by_layer_type: bool = False
    sinks: bool = False
    routed_mlp: bool = False
    experts: bool = False


FAMILIES = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
    "gemma3_text": Family(sandwich=True, norm="gemma", rope_by_layer_type=True),
    "gpt_oss": Family(norm="float32", sinks=True, routed_mlp=True, experts=True),
    # dense layers where mlp_only_layers / decoder_sparse_step say: their MLP module is then the plain SwiGLU
    "qwen3_moe": Family(experts=True),
    "qwen2_moe": Family(experts=True),
}
_SYNC_FREE_EXPERTS = ("grouped_mm", "batched_mm")  # routing on the device: no host read inside a forward
_STATIC_ROPE = ("default", "llama3", "linear", "yarn")  # frequencies fixed at load: one graph serves every length


def family(model: nn.Module) -> Family | None:
    """The model's row of FAMILIES, or None when StaticLM cannot run it (see the module docstring)."""
    cfg = model.config
    fam = FAMILIES.get(cfg.model_type)
    if fam is None or getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "use_bidirectional_attention",
                                                                               False):
        return None
    if not all(r.get("rope_type", "default") in _STATIC_ROPE for r in _rope_parameters(cfg)):
        return None
    return fam if set(layer_types(cfg)) <= {FULL, SLIDING} else None


def capturable(model: nn.Module) -> bool:
    """Whether a forward of `model` can be captured as a CUDA graph (no host reads inside it)."""
    impl = getattr(model.config, "_experts_implementation", None)
    if impl == grouped_experts.NAME:
        return grouped_experts.grouped_gemm_applies(model.get_input_embeddings().weight)
    return not family(model).experts or impl in _SYNC_FREE_EXPERTS


def _rope_parameters(cfg) -> list[dict]:
    """The RoPE parameter sets: one, or one per layer type (Gemma 3)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if all(isinstance(v, dict) for v in params.values()) and params:
        return list(params.values())
    return [params]


def layer_types(cfg) -> list[str]:
    """Each layer's attention type as HF's model of this config applies it: SLIDING where the layer has a
    window (models/document_attention.layer_window: the one rule, which the packed feature forward follows
    too), else the config's own type (FULL, or one `family` refuses)."""
    types = getattr(cfg, "layer_types", None) or [FULL] * cfg.num_hidden_layers
    windows = attention_windows(cfg)  # one a decoder layer: a longer layer_types list is cut to the layers
    return [SLIDING if w is not None else (FULL if t == SLIDING else t) for t, w in zip(types, windows, strict=False)]


def windows(cfg) -> dict[str, int | None]:
    """Per layer type present, how many positions back a query sees (itself included); None: all."""
    return {t: (cfg.sliding_window if t == SLIDING else None) for t in set(layer_types(cfg))}
