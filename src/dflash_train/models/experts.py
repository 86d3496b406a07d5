"""Which kernel runs a mixture-of-experts target's experts (transformers' experts implementation).

    use_experts(target.model, "auto")   # returns the implementation set; None for a dense target

transformers (5.17 and 5.18) routes every expert module it decorates with `use_experts_implementation`
(qwen3_moe, gpt_oss, ...) through `config._experts_implementation`:

    eager       a Python loop over the experts that got tokens, each finding its tokens with a host
                read (nonzero): the reference result; on a GPU a chain of small launches per expert
                and no CUDA graph capture (on a CPU no kernel was consistently faster:
                docs/performance.md#moe-targets)
    grouped_mm  tokens sorted by expert, then two grouped GEMMs over all experts (torch's grouped_mm):
                the routing stays on the device; its CUDA kernels take bf16 (SM80 and later)
    batched_mm  each routed token gathers its expert's weight matrices and runs a bmm: no host reads,
                but it copies k weight matrices per token, so it suits only tiny shapes
    dflash_grouped  dflash-train's own (models/grouped_experts.py): grouped_mm's GEMMs, the expert
                ids sorted as one-byte keys and the top-k combine as one Triton kernel

`auto` picks dflash_grouped for bf16 weights on CUDA (measured 11-17% ahead of grouped_mm on a
Qwen3-30B-A3B forward and level with it in the one-GPU pipeline: docs/performance.md#moe-targets) and
eager elsewhere. The choice is made here, once, so the config never holds `auto`:
decode/architectures.py reads the implementation set to decide whether a forward can be captured as a
CUDA graph.
"""

from __future__ import annotations

import typing
from typing import Literal

import torch
from torch import nn

from dflash_train.errors import UsageError
from dflash_train.models import grouped_experts

ExpertsChoice = Literal["auto", "eager", "grouped_mm", "batched_mm", "dflash_grouped"]
CHOICES: tuple[str, ...] = typing.get_args(ExpertsChoice)


def use_experts(model: nn.Module, choice: str = "auto", *, flag: str = "--target-experts") -> str | None:
    """Set the experts implementation of `model` (a transformers causal LM whose weights are in place).

    Returns the implementation set, or None for a model without routed experts (left as it is).
    """
    if choice not in CHOICES:
        raise UsageError(f"{flag} must be {', '.join(CHOICES[:-1])} or {CHOICES[-1]}, got {choice!r}")
    if not is_moe(model):
        return None
    weight = model.get_input_embeddings().weight  # whole on every rank under tensor parallelism
    impl = resolve(choice, weight.device, weight.dtype)
    if impl == grouped_experts.NAME:
        grouped_experts.register()
    model.set_experts_implementation(impl)
    return impl


def resolve(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """The implementation `choice` means for weights of `dtype` on `device` (see the module docstring)."""
    if choice != "auto":
        return choice
    return grouped_experts.NAME if device.type == "cuda" and dtype == torch.bfloat16 else "eager"


def is_moe(model: nn.Module) -> bool:
    """Whether `model` has expert modules whose implementation transformers lets one choose."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    return bool(can_set and can_set() and hasattr(model, "set_experts_implementation"))
