"""A small model's per-layer projections stacked, so that one GEMM computes q, k and v and one gate and up.

At batch 1 a decode layer is launch-bound: a GEMM of a SmolLM2-sized layer reads a few MB of weights (~1 us of
an H100's bandwidth) but costs ~3.5 us in a CUDA graph, its launch and ramp. Serving engines keep these
projections packed (vLLM's QKVParallelLinear and MergedColumnParallelLinear, SGLang's alike), so their decode
steps run 4 GEMMs a layer where HF's modules run 7; the decode engines here (StaticLM for the target,
StaticDrafter for the drafter) do the same through `PackedWeights`, which also keeps an eval's speedup measured
against a target step as cheap as an engine's.

The stacks are copies, not views of the modules' weights: a checkpoint keeps its layout and training its
parameters. `refresh` copies again whenever a weight changed in place (its version moved) or was replaced (its
address moved): the drafter trains between evals. Packed only where every layer's weights are at most
PACK_BYTES: at Qwen3-8B widths a layer's GEMMs read 350 MB, a launch saved is noise there, and the copies would
cost GBs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
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

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._layers = list(layers)
        self.layers = [PackedLayer() for _ in self._layers]
        self._key: tuple | None = None

    @classmethod
    def of(cls, layers: Sequence[nn.Module]) -> PackedWeights | None:
        """Packed weights for these decoder layers, or None: a layer without plain q/k/v projections, or one
        whose weights exceed PACK_BYTES."""
        groups = [(_qkv(layer), _gate_up(layer)) for layer in layers]
        if not groups or any(qkv is None for qkv, _ in groups):
            return None
        sizes = [sum(w.numel() * w.element_size() for w in qkv[0] + (gate_up or ())) for qkv, gate_up in groups]
        return cls(layers) if max(sizes) <= PACK_BYTES else None

    def refresh(self) -> None:
        """Copy the modules' weights into the stacks if any changed since the last copy. The stacks keep their
        buffers, so graphs captured reading them stay valid."""
        sources = [w for layer in self._layers for w in _sources(layer)]
        key = tuple((w.data_ptr(), w._version) for w in sources)
        if key == self._key:
            return
        with torch.no_grad():
            for layer, packed in zip(self._layers, self.layers, strict=True):
                weights, biases = _qkv(layer)
                packed.qkv = _stacked(packed.qkv, weights)
                packed.qkv_bias = None if biases is None else _stacked(packed.qkv_bias, biases)
                gate_up = _gate_up(layer)
                packed.gate_up = None if gate_up is None else _stacked(packed.gate_up, gate_up)
        self._key = key


def _qkv(layer: nn.Module) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...] | None] | None:
    attn = getattr(layer, "self_attn", None)
    projections = tuple(getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj"))
    if not all(type(p) is nn.Linear for p in projections):  # a quantized or sharded projection: left as it is
        return None
    biases = tuple(p.bias for p in projections) if all(p.bias is not None for p in projections) else None
    if biases is None and any(p.bias is not None for p in projections):
        return None
    return tuple(p.weight for p in projections), biases


def _gate_up(layer: nn.Module) -> tuple[torch.Tensor, ...] | None:
    projections = tuple(getattr(layer.mlp, name, None) for name in ("gate_proj", "up_proj"))
    if not all(type(p) is nn.Linear and p.bias is None for p in projections):  # experts, or a biased MLP
        return None
    return tuple(p.weight for p in projections)


def _sources(layer: nn.Module) -> list[torch.Tensor]:
    weights, biases = _qkv(layer)
    return [*weights, *(biases or ()), *(_gate_up(layer) or ())]


def _stacked(buffer: torch.Tensor | None, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """parts concatenated along rows into `buffer` when it has their shape and place (a refresh), else anew."""
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    first = parts[0]
    if buffer is None or buffer.shape != shape or buffer.dtype != first.dtype or buffer.device != first.device:
        return torch.cat(parts)
    return torch.cat(parts, out=buffer)
