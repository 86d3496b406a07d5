"""A target split over a tensor-parallel group, each rank reading only its own slices.

    target = load_sharded_target(spec, tp_group, device)   # every rank of tp_group calls it

The model is built on the meta device, sharded by models/tp_plan.py (DTensor parameters, no
storage yet), then every parameter is filled from the safetensors shards with `get_slice`, so a
rank reads and holds only its part of the split weights (plus the replicated rest: embedding,
norms, routers, LM head). The Target it returns behaves as load_target's: `features` gives the
full hidden states of the chosen layers on every rank of the group, so any one rank can hand
them on. A group of one loads the whole model the same way (one reader, no transient copy);
load_target_head reads only the embedding, final norm and LM head (and optionally the last layers)
for the processes of a split run that never run the target (the job, the drafter ranks).

spec: an HF model directory with safetensors weights, or random:<preset> (models/presets.py:
weights drawn per parameter from a seed, equal on every rank and for every TP size).

What a train job does with it (every process of a target TP group of size T):
    config = target_config(spec)                       # no weights read
    plan_memory(config, tp=T, device_bytes=..., token_budget=..., n_features=...,
                name=spec)                             # models/memory_plan.py: refuses in one line
    group = dist.new_group(ranks_of_this_tp_group)     # every process calls new_group for every group
    target = load_sharded_target(spec, group, device)  # features() equal on all T ranks
    # the group's first rank hands the features on; the others run the same forwards and drop theirs
T must divide what the plan splits (models/tp_plan.py check_tp_size, tp_sizes in memory_plan).
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dflash_train.errors import UsageError
from dflash_train.models import presets
from dflash_train.models.experts import use_experts
from dflash_train.models.loading import byte_tokenizer, default_dtype
from dflash_train.models.shapes import head_dim
from dflash_train.models.target import Target
from dflash_train.models.tp_plan import check_tp_size, kv_repeats, parallelize_decoder, tensor_plan

# (dim, [(start, stop), ...]): a rank's part, concatenated along dim; no ranges: nothing to read, zeros of the
# whole shape (a Partial parameter's share on every rank but the first, which holds the value: fill_parameters)
Blocks = tuple[int, list[tuple[int, int]]]


def load_sharded_target(spec: str, tp_group: dist.ProcessGroup | None, device: str | torch.device, *,
                        dtype: torch.dtype | None = None, seed: int = 0, flag: str = "--target") -> Target:
    """The frozen target `spec`, its decoder split over `tp_group` (every rank of it calls this); with no
    group, the whole of it, with the same weights. A group larger than the target's KV heads builds the
    model with each KV head repeated (tp_plan.kv_repeats): its config then counts the repeated heads."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    config, source, tokenizer = _open(spec, seed, device, flag)
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    plan = tensor_plan(config) if tp > 1 else {}
    check_tp_size(config, tp)
    if (rep := kv_repeats(config, tp)) > 1:
        config, source = _repeated_kv(config, rep), RepeatedKVHeads(source, head_dim(config), rep)
    model = build_on_meta(config, dtype, device)
    if plan:
        parallelize_decoder(model.base_model, DeviceMesh.from_group(tp_group, device.type), plan)
    with source:
        fill_parameters(model, source, dist.get_rank(tp_group) if tp > 1 else 0, tp, device, dtype)
    model.eval().requires_grad_(False)
    use_experts(model)  # as load_target: the experts' kernel for this device and dtype
    return Target(model=model, tokenizer=tokenizer, spec=spec)


def load_target_head(spec: str, device: str | torch.device, *, last_layers: int = 0, dtype: torch.dtype | None = None,
                     seed: int = 0, flag: str = "--target") -> Target:
    """What a process of a split run uses of the target without running it: the embedding, final norm and LM
    head (the drafter embeds and scores with them), plus its last `last_layers` decoder layers when the drafter
    starts as a copy of them (--init-from-target). No process holds the whole target: its replicas hold the
    layers, split. The weights equal load_sharded_target's on a device of the same type (same reader, same
    seed); `features` cannot run on it."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    config, source, tokenizer = _open(spec, seed, device, flag)
    model = build_on_meta(config, dtype, device)
    layers = model.base_model.layers
    kept = list(layers)[max(0, len(layers) - last_layers):] if last_layers else []
    for i in range(len(layers) - len(kept)):
        layers[i] = nn.Module()  # no parameters to read; the kept layers keep their names (and checkpoint keys)
    with source:
        fill_parameters(model, source, 0, 1, device, dtype)
    model.base_model.layers = nn.ModuleList(kept)
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, spec=spec)


def _repeated_kv(config, rep: int):
    """A copy of `config` with `rep` times the KV heads: the same function (every query head's KV head is a
    copy of its group's), built with one KV head per rank. head_dim is pinned: some configs derive it."""
    out = copy.deepcopy(config)
    out.head_dim = head_dim(config)
    out.num_key_value_heads = config.num_key_value_heads * rep
    return out


class RepeatedKVHeads:
    """A weight reader whose KV projections (weight and bias rows) have each head repeated `rep` times:
    repeated head j reads head j // rep of `source`."""

    _KV = re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$")

    def __init__(self, source, head_dim: int, rep: int) -> None:
        self.source, self.head_dim, self.rep = source, head_dim, rep

    def __enter__(self):
        self.source.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.source.__exit__(*exc)

    def read(self, name: str, shape: torch.Size, blocks: Blocks | None) -> torch.Tensor:
        if not self._KV.search(name):
            return self.source.read(name, shape, blocks)
        real = torch.Size((shape[0] // self.rep, *shape[1:]))
        dim, ranges = blocks or (0, [(0, shape[0])])
        if dim != 0:  # the plan splits KV projections by output rows (colwise)
            raise UsageError(f"--target-tp: {name} is split along dim {dim}; repeated KV heads need rows")
        hd = self.head_dim
        if any(start % hd or stop % hd for start, stop in ranges):
            raise UsageError(f"--target-tp: {name} is split inside a head; repeated KV heads need whole heads")
        heads = [h for start, stop in ranges for h in range(start // hd, stop // hd)]
        return torch.cat([self.source.read(name, real, (0, [((h // self.rep) * hd, (h // self.rep + 1) * hd)]))
                          for h in heads])


def target_config(spec: str, flag: str = "--target"):
    """The transformers config of `spec` (a preset or an HF directory), without reading weights."""
    from transformers import AutoConfig

    if spec.startswith("random:") and spec.removeprefix("random:") in presets.PRESETS:
        return presets.hf_config(spec.removeprefix("random:"))
    if (Path(spec) / "config.json").is_file():
        return AutoConfig.from_pretrained(spec)
    raise UsageError(f"{flag} {spec}: memory planning reads an HF model directory or random:<preset>")


def build_on_meta(config, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model with every parameter on the meta device; its computed buffers (rotary
    frequencies, embedding scales) materialized on `device` by the model's own initializer."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for module in model.modules():
        meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
        if meta:  # its parameters are still meta: the initializer only computes the buffers
            model._init_weights(module)
    return model


def fill_parameters(model: nn.Module, source, rank: int, tp: int, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter its storage: the rank's slices of a DTensor, the whole of the rest."""
    for name, param in list(model.named_parameters()):
        owner, _, pname = name.rpartition(".")
        module = model.get_submodule(owner)
        if isinstance(param, DTensor):
            blocks = local_blocks(param.shape, param.placements[0], rank, tp)
            if blocks[1]:
                local = source.read(name, param.shape, blocks).to(device=device, dtype=dtype)
            else:  # a Partial parameter's share on a rank that does not hold the value: nothing to read
                local = torch.zeros(param.shape, device=device, dtype=dtype)
            value = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                       shape=param.shape, stride=param.stride())
        else:
            value = source.read(name, param.shape, None).to(device=device, dtype=dtype)
        module._parameters[pname] = nn.Parameter(value, requires_grad=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def local_blocks(shape: torch.Size, placement: Placement, rank: int, tp: int) -> Blocks:
    """The index ranges along one dimension that `rank` of `tp` holds under `placement`."""
    if isinstance(placement, Partial):  # summed over the group: the value counted once, on rank 0
        return 0, [(0, shape[0])] if rank == 0 else []
    if isinstance(placement, _StridedShard):  # [a; b] packed: the rank's slice of each of the split_factor parts
        d, parts = placement.dim % len(shape), placement.split_factor
        chunk = shape[d] // parts
        step = chunk // tp
        return d, [(p * chunk + rank * step, p * chunk + (rank + 1) * step) for p in range(parts)]
    if isinstance(placement, Shard):
        d = placement.dim % len(shape)
        step = shape[d] // tp
        return d, [(rank * step, (rank + 1) * step)]
    return 0, [(0, shape[0])]


def _open(spec: str, seed: int, device: torch.device, flag: str):
    from transformers import AutoConfig, AutoTokenizer

    if spec.startswith("random:"):
        name = spec.removeprefix("random:")
        if name not in presets.PRESETS:
            raise UsageError(f"{flag}: unknown preset {spec} (choose from {', '.join(sorted(presets.PRESETS))})")
        return presets.hf_config(name), RandomWeights(seed, presets.hf_config(name), device), byte_tokenizer()
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise UsageError(f"{flag} {spec}: a tensor-parallel target is an HF model directory with safetensors "
                         "weights or random:<preset>")
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, clean_up_tokenization_spaces=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag}: cannot load the tokenizer of {spec}: {str(e).splitlines()[0]}") from None
    return AutoConfig.from_pretrained(spec), SafetensorsShards(path, flag), tokenizer


class SafetensorsShards:
    """The weights of an HF directory (one model.safetensors or an indexed set of shards), read by slice.

    Fused expert parameters ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) are also read from the
    per-expert layout checkpoints use (experts.{e}.gate_proj/up_proj/down_proj.weight).
    """

    def __init__(self, path: Path, flag: str) -> None:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").is_file():
            files = None
        else:
            raise UsageError(f"{flag} {path}: no model.safetensors or model.safetensors.index.json "
                             "(tensor parallelism reads safetensors weights)")
        self.path, self.flag, self.files, self._stack = path, flag, files, contextlib.ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def read(self, name: str, shape: torch.Size, blocks: Blocks | None) -> torch.Tensor:
        if self._has(name):
            return self._read_key(name, blocks)
        stem, _, leaf = name.rpartition(".")
        if stem.endswith(".experts") and self._has(f"{stem}.0.down_proj.weight"):
            blocks = blocks or (1, [(0, shape[1])])
            return torch.stack([self._read_expert(stem, e, leaf, blocks) for e in range(shape[0])])
        if self._has(f"{name}_blocks"):
            raise UsageError(f"{self.flag} {self.path}: {name} is MXFP4-quantized ({name}_blocks); the tensor-parallel "
                             "loader reads unquantized weights: use a bf16 or fp32 copy of the checkpoint")
        raise UsageError(f"{self.flag} {self.path}: the checkpoint has no weight {name}")

    def _read_expert(self, stem: str, e: int, leaf: str, blocks: Blocks) -> torch.Tensor:
        """Expert e's slice of a fused parameter: blocks index the fused tensor, dim 0 being experts."""
        dim, ranges = blocks[0] - 1, blocks[1]
        parts = ["gate_proj", "up_proj"] if leaf == "gate_up_proj" else ["down_proj"]
        out, offset = [], 0
        for part in parts:
            key = f"{stem}.{e}.{part}.weight"
            n = self._slice(key).get_shape()[dim]
            for start, stop in ranges:  # the block's overlap with this part of the packed rows
                lo, hi = max(start, offset), min(stop, offset + n)
                if lo < hi:
                    out.append(self._read_key(key, (dim, [(lo - offset, hi - offset)])))
            offset += n
        return _join(out, dim)

    def _read_key(self, key: str, blocks: Blocks | None) -> torch.Tensor:
        if blocks is None:
            return self._open(self._file(key)).get_tensor(key)
        sl = self._slice(key)
        dim, ranges = blocks
        head = (slice(None),) * dim
        return _join([sl[(*head, slice(start, stop))] for start, stop in ranges], dim)

    def _has(self, key: str) -> bool:
        return key in self.files if self.files is not None else key in self._open("model.safetensors").keys()

    def _file(self, key: str) -> str:
        return self.files[key] if self.files is not None else "model.safetensors"

    def _slice(self, key: str):
        return self._open(self._file(key)).get_slice(key)

    def _open(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(str(self.path / file), framework="pt"))
        return self._handles[file]


def _join(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The parts read, one tensor (no copy for a single part: a large weight is never held twice)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class RandomWeights:
    """Random weights by parameter name: equal on every rank and TP size (drawn whole, then sliced).

    Drawn on the target's device: a 235B-parameter target's draw takes seconds on a GPU, not the
    host's minutes; one seed gives the same weights on every device of a type (as new_drafter's).
    Norm weights are ones (zeros for Gemma's, which scale by 1 + weight) and biases and attention sinks zeros,
    as the models' initializers have them.
    """

    def __init__(self, seed: int, config, device: torch.device) -> None:
        self.seed, self.std, self.device = seed, getattr(config, "initializer_range", 0.02), device
        self.norm = 0.0 if getattr(config, "model_type", "").startswith("gemma") else 1.0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def read(self, name: str, shape: torch.Size, blocks: Blocks | None) -> torch.Tensor:
        whole = self._draw(name, shape)
        if blocks is None:
            return whole
        dim, ranges = blocks
        if ranges == [(0, shape[dim])]:
            return whole
        # a copy, so that the whole draw is freed rather than kept alive under a view
        return torch.cat([whole.narrow(dim, start, stop - start) for start, stop in ranges], dim)

    def _draw(self, name: str, shape: torch.Size) -> torch.Tensor:
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and len(shape) == 1:
            return torch.full(shape, self.norm, device=self.device)
        if leaf in ("bias", "sinks") or leaf.endswith("_bias"):
            return torch.zeros(shape, device=self.device)
        gen = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen, device=self.device).mul_(self.std)
