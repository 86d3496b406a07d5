"""Tensor parallelism of a target's decoder: transformers' per-architecture plan applied with
PyTorch's own `parallelize_module` over a TP device mesh.

    tensor_plan(config)               the plan transformers ships (config.base_model_tp_plan)
    check_tp_size(config, tp)         refuses a TP size the plan cannot split evenly
    parallelize_decoder(decoder, mesh) shards the decoder layers in place (DTensor parameters)

Styles, as transformers names them:
    colwise   a Linear split by output features (attention heads, MLP columns): ColwiseParallel
    rowwise   a Linear split by input features, outputs summed over the group: RowwiseParallel
    packed_colwise / rowwise on 3-D expert parameters, with moe_tp_experts on their module:
              every expert's intermediate dimension split, [gate; up] kept packed
              (ExpertShards: the experts run on their local slices, their outputs summed)
    replicated_with_grad_allreduce  (q_norm, k_norm) stays whole on every rank: inference only
    embedding_rowwise  stays whole too: the drafter side embeds with it as a plain weight
Everything the plan does not name (routers, norms, LM head) is replicated.

Every row-parallel output is all-reduced, so a decoder layer's output is the full hidden state
on every rank: the feature capture of models/target.py works unchanged.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from dflash_train.errors import UsageError

# (config field, what it counts) the plan's column splits must divide
SPLIT_SIZES = (("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads"),
                ("intermediate_size", "MLP columns"), ("moe_intermediate_size", "expert MLP columns"),
                ("shared_expert_intermediate_size", "shared-expert MLP columns"))
# kept whole: norms (inference has no gradient to reduce) and the embedding, which drafter
# workers use as a plain weight (Target.embed) and which is small next to the layers
_REPLICATED = ("replicated_with_grad_allreduce", "embedding_rowwise")
_EXPERT_MODULE = "moe_tp_experts"


def tensor_plan(config, flag: str = "--target-tp") -> dict[str, str]:
    """transformers' TP plan of the architecture: {module or parameter pattern: style}."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise UsageError(f"{flag}: transformers has no tensor-parallel plan for {config.model_type} "
                         f"(config.base_model_tp_plan): use {flag} 1 and a GPU that holds the whole target")
    unknown = sorted({s for s in plan.values()} - {"colwise", "rowwise", "packed_colwise", _EXPERT_MODULE,
                                                   *_REPLICATED})
    if unknown:
        raise UsageError(f"{flag}: the {config.model_type} plan uses styles {unknown} this loader does not apply: "
                         f"use {flag} 1")
    return dict(plan)


def check_tp_size(config, tp: int, flag: str = "--target-tp") -> None:
    """One line naming both numbers when `tp` does not divide what the plan splits."""
    if tp < 1:
        raise UsageError(f"{flag} {tp}: must be 1 or more")
    for field, what in SPLIT_SIZES:
        n = getattr(config, field, None)
        if n and n % tp:
            raise UsageError(f"{flag} {tp} does not divide the {n} {what} of {config.model_type} ({field}): "
                             f"use a divisor of {n}")


def split_parameters(decoder: nn.Module, plan: dict[str, str]) -> set[str]:
    """Names of the decoder's parameters the plan splits over the group (the rest is whole on every rank).

    A row-parallel Linear's bias is added after the sum, so it stays whole.
    """
    out = set()
    for pattern, style in plan.items():
        rx = _pattern(pattern)
        for name, module in decoder.named_modules():
            if rx.match(name) and style in ("colwise", "rowwise") and isinstance(module, nn.Linear):
                out |= {f"{name}.{p}" for p, _ in module.named_parameters() if style == "colwise" or p == "weight"}
        out |= {name for name, param in decoder.named_parameters() if rx.match(name) and param.dim() == 3}
    return out


def _pattern(pattern: str) -> re.Pattern:
    """A plan key ("layers.*.mlp.gate_proj") as a regular expression over module and parameter names."""
    return re.compile(pattern.replace(".", r"\.").replace("*", r"\d+") + "$")


def parallelize_decoder(decoder: nn.Module, mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """Shard `decoder` (a transformers base model, usually still on the meta device) in place."""
    styles: dict[str, ParallelStyle] = {}
    experts: dict[str, dict[str, Placement]] = {}
    for pattern, style in plan.items():
        rx = _pattern(pattern)
        for name, module in decoder.named_modules():
            if rx.match(name):
                if style == _EXPERT_MODULE:
                    experts.setdefault(name, {})
                elif style not in _REPLICATED and isinstance(module, nn.Linear):
                    styles[name] = _linear_style(style)
        for name, param in decoder.named_parameters():
            if rx.match(name) and param.dim() == 3:  # fused experts [E, out, in]: a parameter entry
                owner, _, pname = name.rpartition(".")
                experts.setdefault(owner, {})[pname] = _expert_placement(style)
    styles.update({name: ExpertShards(placements) for name, placements in experts.items()})
    parallelize_module(decoder, mesh, styles)


def _linear_style(style: str) -> ParallelStyle:
    out = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    out.src_data_rank = None  # parameters are empty (meta) here: nothing to scatter, each rank loads its own
    return out


def _expert_placement(style: str) -> Placement:
    """Placement of a fused expert parameter [E, out, in] (a Linear's layout per expert)."""
    if style == "packed_colwise":  # [E, 2I, H] = [gate; up]: rank r holds gate's and up's r-th slices
        return _StridedShard(1, split_factor=2)
    if style == "rowwise":
        return Shard(2)  # split the input (intermediate) dimension
    # a plain column split of fused gate/up rows would hand one rank all the gates: refuse rather than guess
    raise UsageError(f"--target-tp: fused experts split as {style!r} are not supported (packed_colwise and rowwise "
                     "are): use --target-tp 1")


class ExpertShards(ParallelStyle):
    """Fused experts split along their intermediate dimension; partial outputs summed over the group.

    The parameters are DTensors (what loading and memory accounting see); the expert kernels
    index them per expert, so a forward runs on the local slices and DTensor turns the partial
    sums into the full output (an all-reduce by the engine, not by hand).
    """

    def __init__(self, placements: dict[str, Placement]) -> None:
        super().__init__()
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            param = module._parameters[name]
            module._parameters[name] = nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=None), requires_grad=False)
        whole = [n for n, p in module._parameters.items() if p is not None and n not in self.placements]
        if whole:  # a per-expert bias left whole would be added once per rank in the summed outputs
            raise UsageError(f"tensor parallelism: the plan leaves {type(module).__name__}'s {whole} whole")
        module.register_forward_pre_hook(_to_local)
        module.register_forward_hook(_sum_partials(device_mesh))
        return module


def _to_local(module: nn.Module, _args) -> None:
    """Swap DTensor parameters for their local shards for the length of one forward."""
    module._dtensor_params = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    for name, param in module._dtensor_params.items():
        module._parameters[name] = nn.Parameter(param.to_local(), requires_grad=False)


def _sum_partials(mesh: DeviceMesh):
    def hook(module: nn.Module, _args, output: torch.Tensor) -> torch.Tensor:
        module._parameters.update(module._dtensor_params)
        del module._dtensor_params
        return DTensor.from_local(output, mesh, [Partial()], run_check=False).full_tensor()
    return hook
