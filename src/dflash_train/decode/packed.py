"""A small model's per-layer projections stacked, so that one GEMM computes q, k and v and one gate and up.

At batch 1 a decode layer is launch-bound: a GEMM of a SmolLM2-sized layer reads a few MB of weights (~1 us of
an H100's bandwidth) but costs ~3.5 us in a CUDA graph, its launch and ramp. Serving engines keep these
projections packed (vLLM's QKVParallelLinear and MergedColumnParallelLinear, SGLang's alike), so their decode
steps run 4 GEMMs a layer where HF's modules run 7; the decode engines here (StaticLM for the target,
StaticDrafter for the drafter) do the same through `PackedWeights`, which also keeps an eval's speedup measured
against a target step as cheap as an engine's.

The stacks are copies, not views of the modules' weights: a checkpoint keeps its layout and training its
parameters. `refresh` copies again whenever a weight changed in place (its version moved: an optimizer step,
load_state_dict) or was replaced (its address moved): the drafter trains between evals. A write through
`.data` bypasses the version counter and is not seen. Packed only where every layer's weights are at most
PACK_BYTES: at Qwen3-8B widths a layer's GEMMs read 350 MB, a launch saved is noise there, and the copies would
cost GBs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# a layer's q/k/v and gate/up weights up to this many bytes are packed: 16 MB is ~5 us of an H100's bandwidth,
# about a launch; above it a GEMM is mostly reading weights and one launch fewer saves little
PACK_BYTES = 16 << 20


@dataclass
class PackedLayer:
    qkv: torch.Tensor | None = None  # [(heads + 2 kv_heads) * d, H]: q_proj's rows, then k_proj's, then v_proj's
    qkv_bias: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None  # [2 I, H]: gate_proj's rows, then up_proj's; None: not a dense SwiGLU MLP


class PackedWeights:
    """Each layer's projections stacked (see the module docstring), kept equal to the modules' own."""

    def __init__(self, layers: Sequence[nn.Module], gate_up: bool) -> None:
        # the projection modules, found once: refresh runs before graph replays, on the host's clock
        self._qkv = [_qkv(layer) for layer in layers]
        self._gate_up = [_gate_up(layer) if gate_up else None for layer in layers]
        self.layers = [PackedLayer() for _ in layers]
        self._key: tuple | None = None

    @classmethod
    def of(cls, layers: Sequence[nn.Module], gate_up: bool = True) -> PackedWeights | None:
        """Packed weights for these decoder layers (gate/up too where `gate_up` and the MLP is a dense SwiGLU's),
        or None: a layer without plain q/k/v projections, or one whose weights exceed PACK_BYTES."""
        if not layers or any(_qkv(layer) is None for layer in layers):
            return None
        sizes = [sum(m.weight.numel() * m.weight.element_size() for m in _qkv(layer) + (_gate_up(layer) or ()))
                 for layer in layers]
        return cls(layers, gate_up) if max(sizes) <= PACK_BYTES else None

    def refresh(self) -> None:
        """Copy the modules' weights into the stacks if any changed since the last copy. The stacks keep their
        buffers, so graphs captured reading them stay valid; a weight of another shape, dtype or device would
        need new ones, and is refused."""
        sources = [t for modules in self._qkv + self._gate_up for m in modules or () for t in (m.weight, m.bias)
                   if t is not None]
        key = tuple((t.data_ptr(), t._version) for t in sources)
        if key == self._key:
            return
        with torch.no_grad():
            for qkv, gate_up, packed in zip(self._qkv, self._gate_up, self.layers, strict=True):
                packed.qkv = _stacked(packed.qkv, tuple(m.weight for m in qkv))
                if qkv[0].bias is not None:
                    packed.qkv_bias = _stacked(packed.qkv_bias, tuple(m.bias for m in qkv))
                if gate_up is not None:
                    packed.gate_up = _stacked(packed.gate_up, tuple(m.weight for m in gate_up))
        self._key = key


def projections(attn: nn.Module, h: torch.Tensor,
                packed: PackedLayer | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of h [..., H] through an attention module's q/k/v_proj: three GEMMs, or one over its layer's
    packed weights (column slices of that GEMM's output)."""
    if packed is None:
        return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    qkv = F.linear(h, packed.qkv, packed.qkv_bias)
    nq, nkv = attn.q_proj.out_features, attn.k_proj.out_features
    return qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]


def _qkv(layer: nn.Module) -> tuple[nn.Linear, ...] | None:
    """The layer's q, k and v projections, if plain nn.Linear modules all with biases or all without."""
    attn = getattr(layer, "self_attn", None)
    projections = tuple(getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj"))
    if not all(_plain(p) for p in projections):
        return None
    return projections if len({p.bias is None for p in projections}) == 1 else None


def _gate_up(layer: nn.Module) -> tuple[nn.Linear, ...] | None:
    """The layer's gate and up projections, if its MLP is a dense SwiGLU's of plain, bias-free nn.Linear."""
    mlp = getattr(layer, "mlp", None)
    projections = tuple(getattr(mlp, name, None) for name in ("gate_proj", "up_proj"))
    if not all(_plain(p) and p.bias is None for p in projections):  # experts, or a biased MLP
        return None
    return projections


def _plain(module: nn.Module | None) -> bool:
    """An nn.Linear over ordinary tensors: not a quantized module, nor one sharded by tensor parallelism (whose
    weights are DTensors: a stack of their local shards would be another matrix)."""
    return type(module) is nn.Linear and all(type(t.data) is torch.Tensor
                                             for t in (module.weight, module.bias) if t is not None)


def _stacked(buffer: torch.Tensor | None, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """parts concatenated along rows: into `buffer` (a refresh), or anew on the first copy."""
    if buffer is None:
        return torch.cat(parts)
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    if buffer.shape != shape or buffer.dtype != parts[0].dtype or buffer.device != parts[0].device:
        raise RuntimeError("packed weights: a projection changed shape, dtype or device after its decode engine "
                           "was made (graphs may read the old stack): release the engine and make a new one")
    return torch.cat(parts, out=buffer)
