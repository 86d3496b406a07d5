"""StaticLM on Qwen MoE targets (qwen3_moe, qwen2_moe): dense and sparse layers mixed, under transformers' eager
experts loop and its grouped_mm kernel: HF's logits and features, HF's greedy tokens, and lossless DFlash decoding
(float32, CPU)."""

import dataclasses

import pytest
import torch
from static_lm_checks import (
    check_batched_generate,
    check_graph_replays,
    check_hf_verifier,
    check_lossless,
    check_prefill_and_steps,
    check_target_generate,
)
from static_lm_checks import prompts as _prompts
from static_lm_checks import tiny_drafter as _drafter

from dflash_train.decode import architectures, fused_target, static_lm
from dflash_train.decode.generate import generate
from dflash_train.decode.static_lm import StaticLM
from dflash_train.models.experts import use_experts
from dflash_train.models.loading import byte_tokenizer
from dflash_train.models.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls (conftest)

_SHAPE = dict(vocab_size=300, hidden_size=48, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
              num_experts=4, num_experts_per_tok=2)


def _qwen3_moe():
    """Dense layers 0 and 2 (mlp_only_layers), sparse 1 and 3; top-2 weights renormalized."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_SHAPE, num_hidden_layers=4, mlp_only_layers=[0, 2],
                                              norm_topk_prob=True))


def _qwen3_moe_sliding():
    """Every layer slides (a window, no layer_types); every second layer sparse (decoder_sparse_step 2), top-2
    weights as the softmax gives them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_SHAPE, num_hidden_layers=4, decoder_sparse_step=2,
                                              use_sliding_window=True, sliding_window=6))


def _qwen2_moe():
    """A gated shared expert beside the routed ones, biased q/k/v; dense layer 1."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**_SHAPE, num_hidden_layers=3, mlp_only_layers=[1],
                                              shared_expert_intermediate_size=40))


_BUILDERS = {"qwen3_moe": _qwen3_moe, "qwen3_moe-sliding": _qwen3_moe_sliding, "qwen2_moe": _qwen2_moe}
IMPLS = ("eager", "grouped_mm")


def moe_model(arch: str, experts: str = "eager"):
    """A float32 eval-mode model of `arch`, frozen, norms off their init and routers sharpened: the tiny init's
    router logits are near ties, which a last-bit difference in an input could flip to another expert."""
    torch.manual_seed(7)
    model = _BUILDERS[arch]().float().eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.add_(0.5 * torch.randn(p.shape, generator=g))
        elif name.endswith("mlp.gate.weight"):
            p.mul_(50.0)
    assert use_experts(model, experts) == experts
    return model


@pytest.fixture(scope="module", params=[(a, e) for a in _BUILDERS for e in IMPLS], ids="-".join)
def target(request):
    arch, experts = request.param
    return Target(model=moe_model(arch, experts), tokenizer=byte_tokenizer(), spec=f"{arch}-{experts}-test")


def test_rows_and_graph_capture():
    """Both families run; their layers mix dense MLPs and sparse blocks; graphs only where the experts' kernel
    keeps the routing on the device; the fused SwiGLU only where every layer's MLP is one."""
    for arch in _BUILDERS:
        model = moe_model(arch)
        mlps = {type(layer.mlp).__name__.removeprefix("Qwen3").removeprefix("Qwen2") for layer in model.model.layers}
        assert static_lm.supports(model) and mlps == {"MoeMLP", "MoeSparseMoeBlock"}, arch
        assert not architectures.capturable(model) and not fused_target.fusable_mlp(model)
        for impl in ("grouped_mm", "batched_mm"):
            model.set_experts_implementation(impl)
            assert architectures.capturable(model), (arch, impl)
    assert architectures.layer_types(moe_model("qwen3_moe-sliding").config) == [architectures.SLIDING] * 4
    assert architectures.layer_types(moe_model("qwen3_moe").config) == [architectures.FULL] * 4


def test_the_experts_and_the_window_change_the_logits():
    """The checks below see the routing and the window: other router weights, or a wider window, give other
    logits."""
    ids = torch.tensor([_prompts(4)[-1]])
    for arch in _BUILDERS:
        a, b = moe_model(arch), moe_model(arch)
        b.model.layers[-1].mlp.gate.weight.neg_()  # a sparse layer in each
        assert (a(ids).logits[0, -1] - b(ids).logits[0, -1]).abs().max() > 1e-3, arch
    a, b = moe_model("qwen3_moe-sliding"), moe_model("qwen3_moe-sliding")
    b.config.sliding_window = 64
    assert (a(ids).logits[0, -1] - b(ids).logits[0, -1]).abs().max() > 1e-3


@torch.no_grad()
@pytest.mark.parametrize("prefill", [False, True], ids=["masked", "causal"])
def test_prefill_and_steps_equal_hf_forward(target, prefill):
    """A padded batched prefill of prompts of unequal lengths, then one-token steps and a 4-token block: logits
    and features (a dense layer's, a sparse one's, the final-normed output) as HF's forward, within 1e-5."""
    check_prefill_and_steps(target, _prompts(4), (0, 1, target.num_layers - 1), (1, 1, 4, 1), prefill)


@torch.no_grad()
def test_a_wrong_row_is_caught(monkeypatch):
    """The check above fails when the row is wrong: a sparse block taken for one that returns (output, router
    scores) keeps the batch's first row of MLP outputs for every row."""
    target = Target(model=moe_model("qwen3_moe"), tokenizer=byte_tokenizer(), spec="qwen3_moe-test")
    wrong = dataclasses.replace(architectures.FAMILIES["qwen3_moe"], routed_mlp=True)
    monkeypatch.setitem(architectures.FAMILIES, "qwen3_moe", wrong)
    with pytest.raises(AssertionError):
        check_prefill_and_steps(target, _prompts(4), (1,), (1,), True)


def test_batched_generate_equals_hf_generate(target):
    check_batched_generate(target, _prompts(4, seed=1))


def test_target_generate_equals_hf(target):
    check_target_generate(target, _prompts(2, seed=3, base=9))


def test_dflash_is_lossless(target):
    """T=0 DFlash with an untrained drafter."""
    check_lossless(target, _drafter(target), _prompts(3, seed=4, base=8))


def test_dflash_equals_the_hf_verifier(target, monkeypatch):
    check_hf_verifier(target, _drafter(target), _prompts(1, seed=5, base=15)[0], monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", list(_BUILDERS))
def test_cuda_graph_replays_equal_eager_and_hf(arch):
    """float32 on the GPU under batched_mm (routing on the device; grouped_mm's CUDA kernels take bf16): graph
    replays give the eager steps' tokens, and those transformers' greedy ones."""
    check_graph_replays(moe_model(arch, "batched_mm").cuda(), _prompts(4, seed=6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("experts", ["grouped_mm", "dflash_grouped"])
@pytest.mark.parametrize("arch", list(_BUILDERS))
def test_cuda_bf16_grouped_graphs_equal_eager(arch, experts):
    """What loading picks for a bf16 MoE target on CUDA (dflash_grouped; transformers' grouped_mm beside it): graph
    replays of the steps give the eager steps' tokens, and the eager steps the HF modules' logits up to bf16
    rounding."""
    model = moe_model(arch, experts).to("cuda", torch.bfloat16)
    prompts = _prompts(4, seed=7)
    graphed = StaticLM(model)
    assert graphed.graphs
    eager = generate(StaticLM(model, graphs=False), prompts, 16, [], lag=0).rows
    assert generate(graphed, prompts, 16, []).rows == eager
    plain = StaticLM(model, attention_kernel=False, fused=False)
    ids = torch.tensor([prompts[-1]], device="cuda")
    pos = torch.arange(ids.shape[1], device="cuda")[None]
    got = plain.forward(ids, pos, plain.cache_for(1, 64), static_lm.bucket(ids.shape[1]), prefill=True).logits
    torch.testing.assert_close(got.float(), model(ids).logits.float(), rtol=0, atol=0.1)
