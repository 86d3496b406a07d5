"""dflash-train's experts implementation for MoE targets: grouped GEMMs with a short sort and a one-pass combine.

    register()                                   # once; then
    model.set_experts_implementation(NAME)      # or --target-experts dflash_grouped

The math is transformers' `grouped_mm` implementation (models/experts.py): sort the (token, expert)
pairs by expert, gather each pair's token row, two grouped GEMMs over all experts with the gate in
between, then weight each pair's output row and sum a token's k rows. Two of its steps cost more than
their bytes. An H100 profile of Qwen3-30B-A3B's compiled forward (3,072 tokens, 2026-12-05,
benchmarks/results/h100-moe-2026-12-05/moe-kernels-compiled.log) found:
- the combine (gather the rows back into token order, weight, sum over k) as one Inductor kernel of
  165 us a layer for ~126 MB of reads and writes: ~0.8 TB/s, a quarter of the memory's rate;
- the sort of the 24,576 expert ids as 8 radix passes, one per byte of their int64 keys.
Here the ids are sorted as one-byte keys (at most 256 experts: one pass), and the combine is one
Triton kernel per (token, column block) that reads the token's k rows where the GEMMs left them and
their k weights, and writes the token's row once, summing in float32.

Its results equal transformers' eager grouped_mm up to the order of a token's k-term sum: each weight
times row is computed in the two dtypes' promoted dtype and rounded to it (bf16 for a bf16 model, whose
routers return bf16 weights), the sum runs in float32 and is rounded once to that dtype, as eager
PyTorch computes transformers' expression. (Compiled, Inductor fuses that expression without rounding
the products, so transformers' compiled grouped_mm and its eager one differ by that rounding too.) On
CPU, and for weights other than bf16 on CUDA (torch's grouped GEMM kernels take bf16), the GEMMs run
as a loop over the experts reading the offsets on the host, and the combine in torch: the same math,
for tests and small models.

Not supported: transformers' own expert parallelism. Under 5.18 its modules say so and run
transformers' grouped_mm here; 5.17's carry no flag, and their sentinel ids (>= num_experts) would
index past the experts. dflash-train's tensor parallelism (models/tp_plan.py) splits each expert's
columns and keeps every expert on every rank, which this runs as it is. The target's feature forward
needs no gradient: the combine has no backward (compiling it with gradients enabled fails).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_train.devices import triton_device, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None

NAME = "dflash_grouped"
_COMBINE_BLOCK = 1024  # columns per program: a 2,048-wide row is two programs of k 2 KB reads each


def register() -> None:
    """Make NAME a valid experts implementation for every transformers model in this process."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NAME, grouped_experts_forward)


def grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's output for hidden_states [T, H] routed to top_k_index [T, k] with top_k_weights."""
    if getattr(self, "_is_expert_parallel", False):  # transformers' expert parallelism (5.18): sentinel ids
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return ALL_EXPERTS_FUNCTIONS["grouped_mm"](self, hidden_states, top_k_index, top_k_weights)
    k = top_k_index.shape[-1]
    expert_ids, perm = torch.sort(sort_keys(top_k_index.reshape(-1), self.num_experts), stable=True)
    expert_ids = expert_ids.to(torch.int32)  # searchsorted's and the bias gather's index type
    # offsets[e]: pairs routed to experts 0..e, found in the sorted ids without a host read
    bounds = torch.arange(1, self.num_experts + 1, device=expert_ids.device, dtype=torch.int32)
    offsets = torch.searchsorted(expert_ids, bounds, out_int32=True)
    rows = hidden_states[perm // k]
    if self.has_gate:
        up = _grouped_linear(self, rows, self.gate_up_proj, "gate_up_proj_bias", expert_ids, offsets)
        act = self._apply_gate(up)
    else:
        act = self.act_fn(_grouped_linear(self, rows, self.up_proj, "up_proj_bias", expert_ids, offsets))
    down = _grouped_linear(self, act, self.down_proj, "down_proj_bias", expert_ids, offsets)
    slots = torch.empty_like(perm)  # slots[pair] = where the sort put it
    slots[perm] = torch.arange(perm.numel(), device=perm.device)
    return combine(down, slots, top_k_weights.reshape(-1, k)).to(hidden_states.dtype)


def sort_keys(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The narrowest integer type that holds every expert id: a radix sort makes one pass per byte."""
    if num_experts <= 256:
        return expert_ids.to(torch.uint8)
    if num_experts <= 32768:
        return expert_ids.to(torch.int16)
    return expert_ids.to(torch.int32)


def _grouped_linear(self: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias_name: str, expert_ids: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in] sorted by expert through each expert's weight; transformers stores it [E, out, in], or [E, in, out]
    when the module `is_transposed` (gpt_oss)."""
    w = weight if self.is_transposed else weight.transpose(-2, -1)  # [E, in, out]
    x = x.to(w.dtype)
    if grouped_gemm_applies(w):
        out = torch.nn.functional.grouped_mm(x, w, offs=offsets)
    else:
        out = _looped_mm(x, w, offsets)
    if self.has_bias:
        out.add_(getattr(self, bias_name)[expert_ids])  # in out's dtype, as transformers adds it
    return out


def grouped_gemm_applies(weight: torch.Tensor) -> bool:
    """Whether weights like `weight` run torch's grouped GEMM (no host read) rather than the per-expert loop."""
    return weight.is_cuda and weight.dtype == torch.bfloat16


def _looped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM as one matmul per expert (offsets read on the host): the CPU's path."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def combine(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * rows[slots[t * k + j]]: each product rounded to the two dtypes'
    promoted dtype, the sum in float32 rounded once to it (the dtype of the result). rows [S, H] (the
    experts' outputs in sorted order), slots [T * k], weights [T, k]."""
    if _kernel_applies(rows):
        return _combine_op(rows, slots, weights)
    return combine_reference(rows, slots, weights)


def combine_reference(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    t, k = weights.shape
    products = rows[slots].view(t, k, -1) * weights.unsqueeze(-1)
    return products.float().sum(dim=1).to(products.dtype)


def _kernel_applies(rows: torch.Tensor) -> bool:
    return triton is not None and triton_runs_on(rows.device)


@torch.library.custom_op("dflash_train::moe_combine", mutates_args=())
def _combine_op(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    t, k = weights.shape
    width = rows.shape[-1]
    rows, slots, weights = rows.contiguous(), slots.contiguous(), weights.contiguous()
    out = rows.new_empty(t, width, dtype=torch.promote_types(rows.dtype, weights.dtype))
    with triton_device(rows.device):
        _combine_kernel[(t, triton.cdiv(width, _COMBINE_BLOCK))](rows, slots, weights, out, width, K=k,
                                                                 ROUND=out.dtype != torch.float32,
                                                                 BLOCK=_COMBINE_BLOCK, num_warps=4)
    return out


@_combine_op.register_fake
def _(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(weights.shape[0], rows.shape[-1], dtype=torch.promote_types(rows.dtype, weights.dtype))


if triton is not None:
    @triton.jit
    def _combine_kernel(Rows, Slots, Weights, Out, width, K: tl.constexpr, ROUND: tl.constexpr,
                        BLOCK: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            slot = tl.load(Slots + t * K + j).to(tl.int64)
            w = tl.load(Weights + t * K + j).to(tl.float32)
            product = w * tl.load(Rows + slot * width + cols, mask=inside, other=0.0).to(tl.float32)
            if ROUND:  # the product in the result's dtype, as eager PyTorch computes it
                product = product.to(Out.dtype.element_ty).to(tl.float32)
            acc += product
        tl.store(Out + t.to(tl.int64) * width + cols, acc.to(Out.dtype.element_ty), mask=inside)
