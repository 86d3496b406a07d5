"""dflash-train's experts implementation (models/grouped_experts.py): its sort keys, its combine kernel (run by
triton's interpreter on the CPU, in a child process: the interpreter is chosen when triton is imported) and
its math against transformers' eager experts (tests/test_moe_targets.py compares whole targets' features)."""


import pytest
import torch
from conftest import run_interpreted

from dflash_train.models import grouped_experts
from dflash_train.models.grouped_experts import combine_reference, sort_keys


def test_one_byte_keys_sort_as_the_ids_do():
    ids = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))  # past int8's range
    keys = sort_keys(ids, 256)
    assert keys.dtype == torch.uint8
    want_ids, want_perm = torch.sort(ids, stable=True)
    got_ids, got_perm = torch.sort(keys, stable=True)
    assert torch.equal(got_ids.long(), want_ids) and torch.equal(got_perm, want_perm)
    assert sort_keys(ids, 257).dtype == torch.int16 and sort_keys(ids, 40000).dtype == torch.int32


def _routed(t: int, k: int, width: int, experts: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
    _, perm = torch.sort(ids.reshape(-1), stable=True)
    rows = torch.randn(t * k, width, generator=g).to(dtype)
    slots = torch.empty_like(perm)
    slots[perm] = torch.arange(perm.numel())
    weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype)
    return rows, perm, slots, weights


def test_the_reference_combine_sums_each_tokens_weighted_rows_back_in_token_order():
    rows, perm, slots, weights = _routed(t=5, k=3, width=7, experts=6)
    unsorted = torch.empty_like(rows)
    unsorted[perm] = rows  # row of pair p (token p // k) where the sort took it from
    want = (unsorted.view(5, 3, 7) * weights.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(combine_reference(rows, slots, weights), want)


def test_the_reference_combine_rounds_each_product_as_transformers_expression_does():
    """bf16 routing weights (a bf16 model's): each weighted row rounded to bf16, then the k rows summed in
    float32 and rounded once; float32 weights: the products and the result stay float32."""
    for weight_dtype in (torch.bfloat16, torch.float32):
        rows, perm, slots, weights = _routed(t=64, k=4, width=96, experts=8, dtype=torch.bfloat16)
        weights = weights.to(weight_dtype)
        weighted = rows * weights.reshape(-1)[perm].unsqueeze(-1)  # transformers' grouped_mm, in sorted order
        want = weighted[slots].view(64, 4, 96).sum(dim=1)
        got = combine_reference(rows, slots, weights)
        assert got.dtype == want.dtype == torch.promote_types(torch.bfloat16, weight_dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _qwen3_experts(num_experts: int):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=num_experts, num_experts_per_tok=2)
    return Qwen3MoeExperts(cfg)


def _gpt_oss_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return GptOssExperts(GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=8,
                                      num_experts_per_tok=2))


@pytest.mark.parametrize("module", ["qwen3_moe-8", "qwen3_moe-256", "qwen3_moe-300", "gpt_oss-8"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_an_experts_module_equals_transformers_grouped_mm_bit_for_bit(module, weight_dtype, monkeypatch):
    """The CUDA path's math on the CPU (torch's grouped GEMM, bf16): one-byte keys (8, 256 experts), two-byte
    keys (300), experts that get no token (300 experts, 64 tokens), gpt_oss's biases, transposed weights and
    interleaved gate; bf16 routing weights (rounded products) and float32 ones (a float32 result)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    monkeypatch.setattr(grouped_experts, "grouped_gemm_applies", lambda w: w.dtype == torch.bfloat16)
    family, experts = module.split("-")
    torch.manual_seed(0)
    ex = _gpt_oss_experts() if family == "gpt_oss" else _qwen3_experts(int(experts))
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ex = ex.to(torch.bfloat16)
    t, k = 64, 2
    x = torch.randn(t, 64).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(ex.num_experts)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k), -1).to(weight_dtype)
    want = ALL_EXPERTS_FUNCTIONS["grouped_mm"](ex, x, idx, w)
    got = grouped_experts.grouped_experts_forward(ex, x, idx, w)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


_KERNEL_CHECK = r"""
import torch
from dflash_train.models import grouped_experts as g
from test_grouped_experts import _routed
assert g._kernel_applies(torch.empty(1))
cases = ((9, 8, 1500, torch.float32, torch.float32), (4, 2, 64, torch.float16, torch.float16),
         (4, 2, 64, torch.float16, torch.float32))  # rounded products; float32 products of half rows
for t, k, width, dtype, weight_dtype in cases:
    rows, _, slots, weights = _routed(t, k, width, experts=16, dtype=dtype)
    weights = weights.to(weight_dtype)
    got = g.combine(rows, slots, weights)
    want = g.combine_reference(rows, slots, weights)
    assert got.dtype == want.dtype == torch.promote_types(dtype, weight_dtype) and got.shape == (t, width)
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-6)  # sum order
print("ok")
"""


@pytest.mark.skipif(grouped_experts.triton is None, reason="triton is not installed")
def test_the_combine_kernel_equals_the_reference():
    """A width over one column block (1,500 > 1,024: the masked tail) and half-precision rows, with half
    weights (each product rounded) and float32 ones. (Not bf16: the interpreter truncates float32 to bf16,
    where the GPU's conversion, like torch's, rounds to nearest even.)"""
    assert run_interpreted(_KERNEL_CHECK, timeout=300).strip().endswith("ok")


_COMPILED_CHECK = r"""
import torch
from dflash_train.models import grouped_experts as g
from test_grouped_experts import _qwen3_experts
g.grouped_gemm_applies = lambda w: w.dtype == torch.bfloat16  # the CUDA path's math, on the CPU
torch.manual_seed(0)
ex = _qwen3_experts(8)
for p in ex.parameters():
    torch.nn.init.normal_(p, std=0.1)
ex = ex.to(torch.bfloat16).requires_grad_(False)  # a target's experts: frozen
x = torch.randn(64, 64).to(torch.bfloat16)
idx = torch.stack([torch.randperm(8)[:2] for _ in range(64)])
compiled = torch.compile(lambda a, b, c: g.grouped_experts_forward(ex, a, b, c), fullgraph=True)
for weight_dtype in (torch.bfloat16, torch.float32):
    w = torch.softmax(torch.randn(64, 2), -1).to(weight_dtype)
    with torch.no_grad():
        want, got = g.grouped_experts_forward(ex, x, idx, w), compiled(x, idx, w)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # Inductor's fused gate rounds less
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(grouped_experts.triton is None, reason="triton is not installed")
def test_a_compiled_forward_is_one_graph_through_the_combine_kernel():
    """fullgraph: no graph break at the custom op, and its fake (the shapes and dtype a compiled graph
    plans with) agrees with what the kernel returns."""
    assert run_interpreted(_COMPILED_CHECK, timeout=300).strip().endswith("ok")
