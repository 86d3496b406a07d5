"""DFlash drafter configuration and its reference (z-lab) `config.json` form.

The drafter is a stack of Qwen3-style layers, so the saved config is a Qwen3 config
(`model_type: "qwen3"`) plus the DFlash fields the reference implementation, SGLang and
vLLM read: `architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers`,
`layer_types` and `dflash_config: {mask_token_id, target_layer_ids}`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_train.config import MAX_BLOCK_SIZE, MAX_MLP_RATIO, RELEASED, between
from dflash_train.devices import check_fits
from dflash_train.errors import UsageError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# Sizes that shape a tensor: whole numbers >= 1, and what init-drafter and train call them.
_SIZES = {"hidden_size": None, "intermediate_size": "--intermediate-size", "num_hidden_layers": "--num-layers",
          "num_attention_heads": None, "num_key_value_heads": None, "head_dim": None, "vocab_size": None,
          "block_size": "--block-size", "num_target_layers": None, "max_position_embeddings": None}


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Feature layers spread evenly from 1 to N-3 (rounded); one feature takes the middle layer.

    Id L is the OUTPUT of target decoder layer L, i.e. HF `hidden_states[L + 1]`.
    Qwen3-8B (36 layers), 5 features -> [1, 9, 17, 25, 33].
    """
    if num_features < 1:
        raise UsageError(f"--num-features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    # Python's round() is banker's rounding; the reference uses it too, so ids match.
    return [round(start + i * (end - start) / (num_features - 1)) for i in range(num_features)]


@dataclass(kw_only=True, slots=True)
class DFlashConfig:
    """Shape and DFlash settings of a drafter. Validated on construction."""

    hidden_size: int
    """Must equal the target's hidden size (the drafter reads the target's features and embedding)."""
    intermediate_size: int
    num_hidden_layers: int
    """Number of draft layers (5 in the released Qwen3-8B drafter)."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """The target's vocabulary (embedding rows); the drafter has no embedding of its own."""
    block_size: int = RELEASED["block_size"]
    """The reference layout's block size when config.json names none."""
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    layer_types: list[str] = field(default_factory=list)
    """Per draft layer: "full_attention" (default) or "sliding_attention"."""
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    dtype: str = "bfloat16"
    """Storage dtype written to config.json (`torch_dtype`)."""
    mask_token: str | None = None
    """The mask token's text in the target's tokenizer (SGLang resolves the id from it); None for a
    spare embedding row, which has no text."""

    def __post_init__(self) -> None:
        self._check_sizes()  # before num_hidden_layers sizes the default layer_types
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    def validate(self) -> None:
        self._check_sizes()
        self._check_floats()
        _need(self.num_attention_heads % max(self.num_key_value_heads, 1) == 0, "num_key_value_heads",
              f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}")
        _need(len(self.target_layer_ids) >= 1, "target_layer_ids", "must name at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        _need(not bad, "target_layer_ids",
              f"{bad} out of range for a target of {self.num_target_layers} layers "
              f"(valid 0..{self.num_target_layers - 2})")
        # vLLM and SGLang capture layer L's output as the input of layer L+1, which never runs for N-1
        last = [i for i in self.target_layer_ids if i == self.num_target_layers - 1]
        _need(not last, "target_layer_ids", f"{last} is the target's last layer; serving engines capture a layer's "
              f"output before the next layer, so ids go up to N-2 = {self.num_target_layers - 2}")
        _need(self.hidden_act == "silu", "hidden_act",
              f"{self.hidden_act!r} is not supported (the draft MLP is SwiGLU: silu)")
        _need(0 <= self.mask_token_id < self.vocab_size, "mask_token_id",
              f"{self.mask_token_id} is not a row of the target's embedding (vocab_size={self.vocab_size})")
        _need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
              f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        _need(not unknown, "layer_types", f"unknown layer type(s) {sorted(unknown)}")
        if SLIDING_ATTENTION in self.layer_types:
            _need(bool(self.sliding_window) and self.sliding_window > 0, "sliding_window",
                  "must be a positive integer when layer_types has sliding_attention layers")

    def _check_sizes(self) -> None:
        """Whole numbers >= 1 within the bounds that keep a typo from sizing a huge allocation."""
        for name in _SIZES:
            value = getattr(self, name)
            _need(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                  f"must be a whole number >= 1, got {value!r}")
        _need(not (why := between(2, MAX_BLOCK_SIZE)(self.block_size)), "block_size", why or "")
        cap = MAX_MLP_RATIO * self.hidden_size
        _need(self.intermediate_size <= cap, "intermediate_size",
              f"must be <= {cap} ({MAX_MLP_RATIO} x hidden_size {self.hidden_size}), got {self.intermediate_size}")
        # a drafter as deep as its target costs as much as the target's own forward: nothing to gain
        _need(self.num_hidden_layers <= self.num_target_layers, "num_hidden_layers",
              f"must be <= the target's {self.num_target_layers} layers, got {self.num_hidden_layers}")

    def _check_floats(self) -> None:
        """NaN passes every comparison's `not`, and a zero or negative eps divides by zero in RMSNorm."""
        for name, value in (("rms_norm_eps", self.rms_norm_eps), ("rope_theta", self.rope_theta)):
            _need(_finite(value) and value > 0, name, f"must be a finite number > 0, got {value!r}")
        _need(_finite(self.initializer_range) and self.initializer_range >= 0, "initializer_range",
              f"must be a finite number >= 0, got {self.initializer_range!r}")

    @classmethod
    def from_flags(cls, **kwargs: Any) -> DFlashConfig:
        """A config shaped by init-drafter's or train's flags: an error names the flag, not the config field."""
        try:
            return cls(**kwargs)
        except UsageError as e:
            name, _, why = str(e).partition(":")
            raise UsageError(f"{_SIZES[name]}{why}" if _SIZES.get(name) else str(e)) from None

    def num_parameters(self) -> int:
        """The drafter's parameters (models/drafter.py), from the shapes alone: before building it."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * (q + 2 * kv) + q * h + 2 * d + ((q + 2 * kv + h) if self.attention_bias else 0)
        layer = attn + 3 * h * self.intermediate_size + 2 * h  # + MLP and the two norms
        return self.num_hidden_layers * layer + len(self.target_layer_ids) * h * h + 2 * h  # + fc, two norms

    def check_fits(self, device: torch.device | str, bytes_per_parameter: int = 4) -> None:
        """The drafter's weights must fit `device`'s free memory; checked before they are allocated."""
        n = self.num_parameters()
        check_fits(n * bytes_per_parameter, torch.device(device),
                   f"a drafter of {self.num_hidden_layers} layers of MLP width {self.intermediate_size} "
                   f"({n / 1e6:.0f}M parameters; --num-layers, --intermediate-size)")

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 1e6))

    # --- reference config.json --------------------------------------------------------

    def to_reference_dict(self) -> dict[str, Any]:
        """The z-lab `config.json` content."""
        rope_scaling = (None if self.rope_parameters.get("rope_type", "default") == "default"
                        else dict(self.rope_parameters))
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                  "block_size": self.block_size}  # SGLang reads dflash_config's block_size first
        if self.mask_token is not None:
            dflash["mask_token"] = self.mask_token
        causality = {}
        if SLIDING_ATTENTION not in self.layer_types:
            # Stated, not left to defaults: every layer non-causal (a global flag in vLLM, the reference and
            # SGLang). With sliding layers no engine has a per-layer key; all three default sliding layers to
            # causal-within-window and full layers to non-causal, which is what we train (docs/models.md).
            causality = {"is_causal": False}
            dflash["causal"] = False
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": dflash,
            **causality,
            "num_target_layers": self.num_target_layers,
            "layer_types": list(self.layer_types),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": dict(self.rope_parameters),
            "rope_scaling": rope_scaling,
            "sliding_window": self.sliding_window,
            "use_sliding_window": SLIDING_ATTENTION in self.layer_types,
            "max_window_layers": self.num_hidden_layers,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": False,
            "use_cache": True,
            "torch_dtype": self.dtype,
        }

    @classmethod
    def from_reference_dict(cls, d: dict[str, Any], source: str = "config.json") -> DFlashConfig:
        """Parse a reference config; errors name `source` and the offending field."""
        archs = d.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise UsageError(f"{source}: architectures is {archs!r}, not a DFlash drafter (expected DFlashDraftModel)")
        dflash = d.get("dflash_config") or {}
        _refuse_unsupported(d, dflash, source)
        if "block_size" in dflash and "block_size" in d and dflash["block_size"] != d["block_size"]:
            raise UsageError(f"{source}: block_size {d['block_size']!r} and dflash_config.block_size "
                             f"{dflash['block_size']!r} differ (engines read one or the other)")
        mask = dflash.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise UsageError(f"{source}: dflash_config.mask_token_id is missing")
        n_layers = _field(d, "num_hidden_layers", source)
        num_target_layers = _field(d, "num_target_layers", source)
        ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        if ids is None:
            ids = default_target_layer_ids(num_target_layers, n_layers)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope = {"rope_type": rope.get("rope_type", rope.get("type", "default")), **rope}
        rope.setdefault("rope_theta", d.get("rope_theta", 1e6))
        heads = _field(d, "num_attention_heads", source)
        hidden = _field(d, "hidden_size", source)
        try:
            return cls(
                hidden_size=hidden,
                intermediate_size=_field(d, "intermediate_size", source),
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim") or hidden // heads,
                vocab_size=_field(d, "vocab_size", source),
                block_size=int(dflash.get("block_size", d.get("block_size", RELEASED["block_size"]))),
                mask_token_id=int(mask),
                target_layer_ids=list(ids),
                num_target_layers=num_target_layers,
                layer_types=list(d.get("layer_types") or []),
                sliding_window=d.get("sliding_window") if SLIDING_ATTENTION in (d.get("layer_types") or []) else None,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_parameters=rope,
                max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
                attention_bias=bool(d.get("attention_bias", False)),
                hidden_act=d.get("hidden_act", "silu"),
                dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
                mask_token=dflash.get("mask_token"),
            )
        except UsageError as e:
            raise UsageError(f"{source}: {e}") from None


# Settings other DFlash checkpoints may carry that change the drafter's math, with the value under
# which our drafter computes the same thing. Any other value is refused rather than dropped: the
# checkpoint would be evaluated or fine-tuned as a different model.
_NEUTRAL = {"is_causal": (False, None), "input_embedding_scale": (1, 1.0, None), "output_multiplier": (1, 1.0, None),
            "final_logit_softcapping": (None,), "attn_logit_softcapping": (None,)}
_NEUTRAL_DFLASH = {"causal": (False, None), "is_causal": (False, None)}


def _refuse_unsupported(d: dict[str, Any], dflash: dict[str, Any], source: str) -> None:
    for table, where, prefix in ((_NEUTRAL, d, ""), (_NEUTRAL_DFLASH, dflash, "dflash_config.")):
        for key, ok in table.items():
            if key in where and where[key] not in ok:
                raise UsageError(f"{source}: {prefix}{key} = {where[key]!r} is not supported (the drafter here "
                                 f"computes {prefix}{key} = {ok[0]!r}); refusing to load it as a different model")


def _need(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise UsageError(f"{name}: {msg}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _field(d: dict[str, Any], name: str, source: str) -> Any:
    if name not in d:
        raise UsageError(f"{source}: required field {name!r} is missing")
    return d[name]


def check_against_target(cfg: DFlashConfig, *, hidden_size: int, num_layers: int, vocab_size: int, where: str) -> None:
    """A drafter only works with a target of matching hidden size, depth and vocabulary."""
    if cfg.hidden_size != hidden_size:
        raise UsageError(f"{where}: drafter hidden_size {cfg.hidden_size} != target hidden size {hidden_size}")
    if cfg.num_target_layers != num_layers:
        raise UsageError(f"{where}: drafter num_target_layers {cfg.num_target_layers} != target's {num_layers} layers")
    if cfg.vocab_size != vocab_size:
        raise UsageError(f"{where}: drafter vocab_size {cfg.vocab_size} != target embedding rows {vocab_size}")
