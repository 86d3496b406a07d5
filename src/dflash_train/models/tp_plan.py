"""Tensor parallelism of a target's decoder: the architecture's per-module plan applied with
PyTorch's own `parallelize_module` over a TP device mesh.

    tensor_plan(config)               the plan transformers ships (config.base_model_tp_plan) or, where
                                      it ships none, the project's own (PROJECT_PLANS)
    check_tp_size(config, tp)         refuses a TP size the plan cannot split evenly
    parallelize_decoder(decoder, mesh) shards the decoder layers in place (DTensor parameters)

Styles, as transformers names them:
    colwise   a Linear split by output features (attention heads, MLP columns): ColwiseParallel
    rowwise   a Linear split by input features, outputs summed over the group: RowwiseParallel
              (its bias stays whole: DTensor's linear rule adds bias / T on every rank, once in the sum)
    colwise / packed_colwise / rowwise on a parameter the module uses itself (fused experts
              [E, out, in], or [E, in, out] where the module is_transposed; their [E, out] biases;
              attention sinks, one per head): its outputs split, or its inputs. A fused gate/up
              keeps each rank's gate and up units paired, whether packed [gate; up] or interleaved
              (the module's is_concatenated). A row-parallel bias joins the summed output once:
              rank 0 holds it, the others zeros (a Partial DTensor). The module's forward runs on
              its local slices (LocalShards)
    moe_tp_experts on fused experts: their partial outputs summed over the group (ExpertShards)
    replicated_with_grad_allreduce  (q_norm, k_norm) stays whole on every rank: inference only
    embedding_rowwise  stays whole too: the drafter side embeds with it as a plain weight
Everything the plan does not name (routers, norms, LM head) is replicated.

Every row-parallel output is all-reduced, so a decoder layer's output is the full hidden state
on every rank: the feature capture of models/target.py works unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

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
_COLUMNS = ("colwise", "packed_colwise")

# The project's plans, in transformers' keys and styles, for architectures whose config ships
# none (config.base_model_tp_plan empty); used only then.
PROJECT_PLANS: dict[str, dict[str, str]] = {
    "gpt_oss": {  # heads as Llama's, each rank with its heads' sinks; every expert's intermediate dimension
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.sinks": "colwise",
        "layers.*.mlp.experts.gate_up_proj": "colwise",  # [E, H, 2I], gate and up interleaved
        "layers.*.mlp.experts.gate_up_proj_bias": "colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",  # [E, I, H]
        "layers.*.mlp.experts.down_proj_bias": "rowwise",
        "layers.*.mlp.experts": _EXPERT_MODULE,
    },
}


def has_tensor_plan(config) -> bool:
    """Whether transformers or the project has a TP plan for the architecture (tensor_plan: which)."""
    return bool(getattr(config, "base_model_tp_plan", None) or PROJECT_PLANS.get(config.model_type))


def tensor_plan(config, flag: str = "--target-tp") -> dict[str, str]:
    """The architecture's TP plan: {module or parameter pattern: style}."""
    plan = getattr(config, "base_model_tp_plan", None) or PROJECT_PLANS.get(config.model_type)
    if not plan:
        raise UsageError(f"{flag}: no tensor-parallel plan for {config.model_type} (transformers ships none in "
                         f"config.base_model_tp_plan, nor does this project): use {flag} 1 and a GPU that holds the "
                         "whole target")
    unknown = sorted({s for s in plan.values()} - {"rowwise", *_COLUMNS, _EXPERT_MODULE, *_REPLICATED})
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
        kv = field == "num_key_value_heads"
        if n and n % tp and not (kv and tp % n == 0):
            raise UsageError(f"{flag} {tp} does not divide the {n} {what} of {config.model_type} ({field}): "
                             f"use a divisor of {n}" + (f" or a multiple of {n}" if kv else ""))


def kv_repeats(config, tp: int) -> int:
    """How often each KV head is repeated for `tp` ranks: 1, or tp / KV heads when the group is larger than
    the KV heads (each rank then holds one copy of its query heads' KV head, as grouped-query attention
    shares it; the KV projections are a small part of a layer)."""
    kv = getattr(config, "num_key_value_heads", None)
    return tp // kv if kv and tp > kv else 1


def split_parameters(decoder: nn.Module, plan: dict[str, str]) -> set[str]:
    """Names of the decoder's parameters the plan splits over the group (the rest is whole on every rank)."""
    out = set()
    for name, style, module in _named(decoder, plan):
        if _is_linear(module, style):  # a row-parallel Linear's bias stays whole
            out |= {f"{name}.{p}" for p, _ in module.named_parameters() if style != "rowwise" or p == "weight"}
    for owner, placements in parameter_placements(decoder, plan).items():
        out |= {f"{owner}.{p}" for p, placement in placements.items() if isinstance(placement, Shard | _StridedShard)}
    return out


def parameter_placements(decoder: nn.Module, plan: dict[str, str]) -> dict[str, dict[str, Placement]]:
    """{module: {parameter: placement}} of the parameters the plan names one by one."""
    out: dict[str, dict[str, Placement]] = {}
    for name, style, param in _named(decoder, plan):
        if isinstance(param, nn.Parameter) and style not in _REPLICATED:
            owner, _, pname = name.rpartition(".")
            out.setdefault(owner, {})[pname] = _placement(style, decoder.get_submodule(owner), pname, param.dim())
    return out


def _named(decoder: nn.Module, plan: dict[str, str]) -> Iterator[tuple[str, str, nn.Module | nn.Parameter]]:
    """(name, style, module or parameter) of everything a plan key names."""
    for pattern, style in plan.items():
        rx = _pattern(pattern)
        for name, item in (*decoder.named_modules(), *decoder.named_parameters()):
            if rx.match(name):
                yield name, style, item


def _pattern(pattern: str) -> re.Pattern:
    """A plan key ("layers.*.mlp.gate_proj") as a regular expression over module and parameter names."""
    return re.compile(pattern.replace(".", r"\.").replace("*", r"\d+") + "$")


def _is_linear(module, style: str) -> bool:
    return isinstance(module, nn.Linear) and style in ("colwise", "rowwise")


def _placement(style: str, module: nn.Module, pname: str, ndim: int) -> Placement:
    """How a parameter the plan names is split: see the module docstring."""
    transposed = getattr(module, "is_transposed", False)
    if style in _COLUMNS:
        out_dim = ndim - 1 if ndim < 3 or transposed else 1
        if pname.startswith("gate_up_proj") and getattr(module, "is_concatenated", True):
            return _StridedShard(out_dim, split_factor=2)  # [gate; up]: rank r holds gate's and up's r-th slices
        return Shard(out_dim)  # interleaved [g0, u0, g1, u1, ...]: an even-length slice keeps the pairs
    if style == "rowwise" and ndim == 3:
        return Shard(1 if transposed else 2)  # the input (intermediate) dimension
    if style == "rowwise" and pname.endswith("bias"):
        # Every rank adds its copy to its partial output before the sum: rank 0's bias and zeros elsewhere
        # count it once, exactly (the output is linear in it: experts scale it by the routing weight, then add).
        return Partial()
    raise UsageError(f"--target-tp: {type(module).__name__}.{pname} split as {style!r} is not supported: "
                     "use --target-tp 1")


def parallelize_decoder(decoder: nn.Module, mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """Shard `decoder` (a transformers base model, usually still on the meta device) in place."""
    styles: dict[str, ParallelStyle] = {name: _linear_style(style) for name, style, module in _named(decoder, plan)
                                        if _is_linear(module, style)}
    summed = {name for name, style, _ in _named(decoder, plan) if style == _EXPERT_MODULE}
    placements = parameter_placements(decoder, plan)
    for name in summed | set(placements):
        styles[name] = (ExpertShards if name in summed else LocalShards)(placements.get(name, {}))
    parallelize_module(decoder, mesh, styles)


def _linear_style(style: str) -> ParallelStyle:
    out = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    out.src_data_rank = None  # parameters are empty (meta) here: nothing to scatter, each rank loads its own
    return out


class LocalShards(ParallelStyle):
    """Parameters a module's own forward uses (fused experts, attention sinks), split as placed.

    The parameters are DTensors (what loading and memory accounting see); the module's kernels
    index them per expert or per head, so its forward runs on the local slices, plain tensors
    as a ColwiseParallel projection's outputs are.
    """

    def __init__(self, placements: dict[str, Placement]) -> None:
        super().__init__()
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            module._parameters[name] = nn.Parameter(_placed(module._parameters[name], device_mesh, placement),
                                                    requires_grad=False)
        module.register_forward_pre_hook(_to_local)
        module.register_forward_hook(lambda m, _args, output: self._restore(m, output, device_mesh))
        return module

    def _restore(self, module: nn.Module, output, mesh: DeviceMesh):
        """Put the DTensor parameters back after the forward."""
        module._parameters.update(module._dtensor_params)
        del module._dtensor_params
        return output


class ExpertShards(LocalShards):
    """Fused experts split along their intermediate dimension: DTensor turns the partial outputs
    into the full output (an all-reduce by the engine, not by hand)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        whole = [n for n, p in module._parameters.items() if p is not None and n not in self.placements]
        if whole:  # a per-expert bias left whole would be added once per rank in the summed outputs
            raise UsageError(f"tensor parallelism: the plan leaves {type(module).__name__}'s {whole} whole")
        return super()._apply(module, device_mesh)

    def _restore(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        partial = super()._restore(module, output, mesh)
        return DTensor.from_local(partial, mesh, [Partial()], run_check=False).full_tensor()


def _placed(param: torch.Tensor, mesh: DeviceMesh, placement: Placement) -> DTensor:
    if isinstance(placement, Partial):  # every rank's local value has the whole shape
        return DTensor.from_local(param, mesh, [placement], run_check=False)
    return distribute_tensor(param, mesh, [placement], src_data_rank=None)


def _to_local(module: nn.Module, _args) -> None:
    """Swap DTensor parameters for their local shards for the length of one forward."""
    module._dtensor_params = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    for name, param in module._dtensor_params.items():
        module._parameters[name] = nn.Parameter(param.to_local(), requires_grad=False)
