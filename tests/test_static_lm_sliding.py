"""StaticLM on sliding-window, Gemma 3 and gpt_oss targets: HF's logits and features, HF's greedy tokens, and
lossless DFlash decoding, with prompts longer than the window (float32, CPU)."""

import pytest
import torch
from sliding_targets import SLIDING_ARCHS, sliding_window_model
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

from dflash_train.decode import architectures, static_lm
from dflash_train.decode.generate import generate
from dflash_train.decode.static_lm import StaticLM
from dflash_train.models.loading import byte_tokenizer
from dflash_train.models.target import Target

WINDOW = 6  # sliding_window_model's default


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls (conftest)


@pytest.fixture(scope="module", params=SLIDING_ARCHS)
def target(request):
    return Target(model=sliding_window_model(request.param), tokenizer=byte_tokenizer(),
                  spec=f"{request.param}-sliding-test")


def test_supported_families_and_refusals():
    assert all(static_lm.supports(sliding_window_model(arch)) for arch in SLIDING_ARCHS)
    gemma = sliding_window_model("gemma3")
    gemma.config.attn_logit_softcapping = 50.0  # Gemma 2's score softcap: not ours
    assert not static_lm.supports(gemma)
    assert all(architectures.capturable(sliding_window_model(arch)) for arch in SLIDING_ARCHS)  # grouped_mm experts
    oss = sliding_window_model("gpt_oss")
    oss.config._experts_implementation = "eager"  # its experts pick their tokens with a host read (nonzero)
    assert static_lm.supports(oss) and not architectures.capturable(oss)


def test_the_window_changes_the_logits():
    """The checks below see the window: the same weights with a wider one give other logits."""
    ids = torch.tensor([_prompts(4)[-1]])
    for arch in SLIDING_ARCHS:
        a, b = sliding_window_model(arch)(ids).logits, sliding_window_model(arch, window=64)(ids).logits
        assert (a[0, -1] - b[0, -1]).abs().max() > 1e-3, arch


@torch.no_grad()
@pytest.mark.parametrize("prefill", [False, True], ids=["masked", "causal"])
def test_prefill_and_steps_equal_hf_forward(target, prefill):
    """A padded batched prefill of prompts shorter and longer than the window, then one-token steps and
    a 4-token block: logits and features as HF's forward over the whole sequence."""
    check_prefill_and_steps(target, _prompts(4), (0, 2, target.num_layers - 1), (1, 1, 4, 1), prefill)


def test_batched_generate_equals_hf_generate(target):
    check_batched_generate(target, _prompts(4, seed=1))


def test_target_generate_equals_hf(target):
    check_target_generate(target, _prompts(2, seed=3, base=9))


def test_dflash_is_lossless(target):
    """T=0 DFlash with an untrained drafter."""
    check_lossless(target, _drafter(target), _prompts(3, seed=4, base=8))


def test_the_graphed_drafter_embeds_blocks_as_training_does():
    """Gemma's embedding module scales by sqrt(hidden); training (Target.embed_scale), the eager loop
    (Target.embed), the graphed drafter step and the serving engines all embed the block's tokens so."""
    from dflash_train.decode.static_drafter import StaticDrafter
    from dflash_train.models.drafter import ContextCache

    target = Target(model=sliding_window_model("gemma3"), tokenizer=byte_tokenizer(), spec="gemma3-sliding-test")
    drafter, B, n = _drafter(target), 4, 9
    engine = StaticDrafter(drafter, target.model.get_input_embeddings(), target.lm_head)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, n, len(drafter.config.target_layer_ids) * target.hidden_size, generator=g)
    block = torch.randint(0, 256, (1, B), generator=g)
    with torch.no_grad():
        hidden = drafter(target.embed(block), feats, torch.arange(n + B)[None], cache=ContextCache())
        want = target.lm_head(hidden[:, 1:])[0]
    got = engine.step(feats, block, torch.tensor([0, n, B]), engine.cache_for(64), static_lm.bucket(n + B))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("device_loop", [True, False])
def test_dflash_equals_the_hf_verifier(target, monkeypatch, device_loop):
    """Step for step as the loop that verifies through HF's forward and its sliding-window DynamicCache."""
    drafter = _drafter(target, num_sliding_layers=1, sliding_window=WINDOW)
    check_hf_verifier(target, drafter, _prompts(1, seed=5, base=15)[0], monkeypatch, device_loop=device_loop)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_cuda_graph_replays_equal_eager_and_hf(arch):
    """float32 on the GPU: graph replays give the eager steps' tokens, and those transformers' greedy ones."""
    model = sliding_window_model(arch).cuda()
    if arch == "gpt_oss":  # grouped_mm's CUDA kernels may not take float32; batched_mm is sync-free too
        model.config._experts_implementation = "batched_mm"
    check_graph_replays(model, _prompts(4, seed=6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_cuda_kernels_equal_the_pytorch_math_in_bf16(arch, monkeypatch):
    """bf16 on the GPU, compiled Triton: the windowed decode kernel (every one-token step: MIN_PROGRAMS 1) and
    the fused chains give the PyTorch math's logits up to bf16 rounding, over a prefill and steps past the window."""
    from dflash_train.decode import attention_kernel

    monkeypatch.setattr(attention_kernel, "MIN_PROGRAMS", 1)
    model = sliding_window_model(arch).to("cuda", torch.bfloat16)
    plain, fast = StaticLM(model, attention_kernel=False, fused=False), StaticLM(model)
    assert fast._fused
    prompts = _prompts(4, seed=7)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    ids, pos = ids.cuda(), torch.arange(width, device="cuda").expand(len(prompts), width)
    pairs = [(lm, lm.cache_for(len(prompts), 64)) for lm in (plain, fast)]
    outs = [lm.forward(ids, pos, c, static_lm.bucket(width), prefill=True).logits for lm, c in pairs]
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=0, atol=0.1)
    step_pos = torch.tensor([[len(p)] for p in prompts], device="cuda")
    for n in range(12):
        new = torch.randint(0, 256, (len(prompts), 1), device="cuda")
        a, b = (lm.step(new, step_pos + n, c, static_lm.bucket(width + n + 1)).logits.float().clone()
                for lm, c in pairs)
        torch.testing.assert_close(b, a, rtol=0, atol=0.1)


@pytest.mark.slow
def test_compiled_steps_take_the_eager_steps():
    """StaticLM.compile on a Gemma 3 target: steps over the whole cache, both layer types' masks and RoPE bases
    traced, give the eager tokens, prompts longer than the window included."""
    model = sliding_window_model("gemma3")
    prompts = _prompts(3, seed=8)
    want = generate(StaticLM(model), prompts, 12, [], lag=0).rows
    lm = StaticLM(model)
    lm.compile()
    assert generate(lm, prompts, 12, [], lag=0).rows == want
