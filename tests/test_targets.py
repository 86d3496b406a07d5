"""Target loading and the feature convention: id L = output of decoder layer L = HF hidden_states[L + 1]."""

import pytest
import torch

from dflash_train.errors import UsageError
from dflash_train.models.chat import render_chat
from dflash_train.models.loading import load_target


def test_layer_ids_index_hf_hidden_states(tiny_target):
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        hs = tiny_target.model(ids, output_hidden_states=True).hidden_states
    n = tiny_target.num_layers
    for layer_ids in ([0], [1, 3], [2, 0, 4], [n - 1], [1, n - 1]):
        got = tiny_target.features(ids, layer_ids)
        want = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_train.models.loading import byte_tokenizer
    from dflash_train.models.target import Target

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    return Target(model=model, tokenizer=byte_tokenizer(), spec="tiny-llama")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_capture_is_hf_hidden_states_in_a_cached_forward(arch, tiny_target):
    """The one feature extractor, in the forwards of speculative verification (KV cache, logits):
    Target.capture's hooks give exactly HF's hidden_states[i + 1], the last layer's final norm included."""
    from transformers import DynamicCache

    target = tiny_target if arch == "qwen3" else _tiny_llama()
    n = target.num_layers
    norm = target.decoder.norm.weight
    saved = norm.detach().clone()
    with torch.no_grad():
        norm.mul_(1 + 0.5 * torch.rand(norm.shape, generator=torch.Generator().manual_seed(1)))  # a non-trivial norm
    try:
        cache = DynamicCache(config=target.config)
        layer_ids = [n - 1, 0, 2]
        for ids, start in ((torch.randint(0, 256, (1, 9)), 0), (torch.randint(0, 256, (1, 4)), 9)):  # prefill, verify
            pos = torch.arange(start, start + ids.shape[1])[None]
            with torch.no_grad(), target.capture(layer_ids) as features:
                out = target.model(ids, position_ids=pos, past_key_values=cache, use_cache=True,
                                   output_hidden_states=True)
            want = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
            assert torch.equal(features(), want)
        hooks = [h for layer in target.decoder.layers for h in layer._forward_hooks.values()]  # HF's own stay
        assert not any(h.__qualname__.startswith("_capture.") for h in hooks)  # ours are removed on exit
    finally:
        with torch.no_grad():
            norm.copy_(saved)


def test_features_run_only_needed_layers(tiny_target):
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
             for i, layer in enumerate(tiny_target.decoder.layers)]
    lm_head_calls = []
    hooks.append(tiny_target.lm_head.register_forward_hook(lambda *a: lm_head_calls.append(1)))
    try:
        tiny_target.features(torch.randint(0, 256, (1, 5)), [0, 2])
    finally:
        for h in hooks:
            h.remove()
    assert ran == [0, 1, 2] and not lm_head_calls
    assert len(tiny_target.decoder.layers) == tiny_target.num_layers  # restored


def test_target_is_frozen_and_exposes_parts(tiny_target):
    assert not tiny_target.model.training
    assert not any(p.requires_grad for p in tiny_target.model.parameters())
    ids = torch.tensor([[3, 4]])
    torch.testing.assert_close(tiny_target.embed(ids), tiny_target.model.get_input_embeddings()(ids))
    assert tiny_target.lm_head.weight.shape == (tiny_target.vocab_size, tiny_target.hidden_size)


@pytest.mark.parametrize("spec,match", [
    ("nonsense", "unknown target"),
    ("random:huge", "unknown preset"),
    ("/no/such/model.gguf", "not found"),
])
def test_bad_target_specs(spec, match):
    with pytest.raises(UsageError, match=match):
        load_target(spec)


def test_hf_directory_without_config(tmp_path):
    with pytest.raises(UsageError, match="config.json"):
        load_target(str(tmp_path))


def test_unreachable_hub_id_is_one_line(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable at import time; without this the test waits ~45 s on the network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError) as err:
        load_target("no-such-org/no-such-model")
    assert "--target" in str(err.value) and "\n" not in str(err.value)


def test_local_hf_directory_round_trip(tiny_target, tmp_path):
    tiny_target.model.save_pretrained(tmp_path)
    tiny_target.tokenizer.save_pretrained(tmp_path)
    loaded = load_target(str(tmp_path))
    ids = torch.randint(0, 256, (1, 6))
    torch.testing.assert_close(loaded.features(ids, [1, 2]), tiny_target.features(ids, [1, 2]))
    chat = [{"role": "user", "content": "x"}]
    assert render_chat(loaded, chat) == render_chat(tiny_target, chat)


def test_init_from_target_copies_the_last_layers(tiny_target):
    from dflash_train.models.factory import drafter_config_for, init_from_target, new_drafter

    drafter = new_drafter(drafter_config_for(tiny_target, num_layers=2, block_size=4, dtype="float32")).float()
    init_from_target(drafter, tiny_target)
    src = tiny_target.decoder.layers
    for dst, s in zip(drafter.layers, list(src)[-2:], strict=True):
        torch.testing.assert_close(dst.self_attn.q_proj.weight, s.self_attn.q_proj.weight)
        torch.testing.assert_close(dst.self_attn.k_norm.weight, s.self_attn.k_norm.weight)
        torch.testing.assert_close(dst.mlp.down_proj.weight, s.mlp.down_proj.weight)
        torch.testing.assert_close(dst.post_attention_layernorm.weight, s.post_attention_layernorm.weight)
    torch.testing.assert_close(drafter.norm.weight, tiny_target.decoder.norm.weight)
    with pytest.raises(UsageError, match="--num-layers must be <= the target's 6 layers"):  # no layers to copy
        drafter_config_for(tiny_target, num_layers=7, block_size=4, dtype="float32")


def test_init_from_a_target_with_attention_biases_names_what_it_leaves_out(tiny_target):
    """Qwen2's q/k/v projections carry biases, the draft layers none: the weights are copied, the biases named."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dflash_train.models.factory import drafter_config_for, init_from_target, new_drafter
    from dflash_train.models.target import Target

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    qwen2 = Target(Qwen2ForCausalLM(cfg).float().eval().requires_grad_(False), tiny_target.tokenizer, "qwen2")
    drafter = new_drafter(drafter_config_for(qwen2, num_layers=2, block_size=4, dtype="float32")).float()
    assert init_from_target(drafter, qwen2) == ["the attention's q_proj.bias, k_proj.bias, v_proj.bias"]
    last = qwen2.decoder.layers[-1].self_attn
    torch.testing.assert_close(drafter.layers[1].self_attn.k_proj.weight, last.k_proj.weight)
    assert init_from_target(drafter, tiny_target) == []  # qwen3: no biases


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_init_from_an_moe_target_copies_attention_and_norms_and_leaves_the_mlp(preset):
    """A routed MLP (router and experts) has no dense counterpart: the draft MLP keeps its random init."""
    from dflash_train.models.factory import drafter_config_for, init_from_target, new_drafter

    target = load_target(f"random:{preset}", device="cpu", dtype=torch.float32)
    drafter = new_drafter(drafter_config_for(target, num_layers=2, block_size=4, dtype="float32"), seed=0).float()
    before = drafter.layers[0].mlp.gate_proj.weight.clone()
    init_from_target(drafter, target)
    src = list(target.decoder.layers)[-2]
    torch.testing.assert_close(drafter.layers[0].self_attn.q_proj.weight, src.self_attn.q_proj.weight)
    torch.testing.assert_close(drafter.layers[0].input_layernorm.weight, src.input_layernorm.weight)
    torch.testing.assert_close(drafter.layers[0].mlp.gate_proj.weight, before)


def test_a_wider_mlp_starts_as_the_targets_and_a_narrower_one_is_refused(tiny_target):
    """--intermediate-size: the target's units first, the extra ones silent (down_proj columns zero), not dead."""
    from dflash_train.models.factory import drafter_config_for, init_from_target, new_drafter

    width = tiny_target.config.intermediate_size
    drafter = new_drafter(drafter_config_for(tiny_target, num_layers=2, block_size=4, intermediate_size=2 * width,
                                             dtype="float32")).float()
    init_from_target(drafter, tiny_target)
    x = torch.randn(3, tiny_target.config.hidden_size)
    for dst, src in zip(drafter.layers, list(tiny_target.decoder.layers)[-2:], strict=True):
        assert dst.mlp.up_proj.weight.shape[0] == 2 * width
        torch.testing.assert_close(dst.mlp(x), src.mlp(x.to(src.mlp.up_proj.weight.dtype)).float())
        assert dst.mlp.gate_proj.weight[width:].abs().sum() > 0  # extra units can learn (their gradients flow)
    narrow = new_drafter(drafter_config_for(tiny_target, num_layers=2, block_size=4, intermediate_size=width // 2,
                                            dtype="float32"))
    with pytest.raises(UsageError, match="--init-from-target.*--intermediate-size may widen"):
        init_from_target(narrow, tiny_target)


def test_compiled_layers_give_the_same_features_with_one_graph_for_all_layers():
    """--compile-target: hooks stay outside the graph, the layers share it, eager again afterwards."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    target = load_target("random:tiny", device="cpu")
    ids = torch.randint(0, 100, (1, 48))
    ref = target.features(ids, [0, 1, 3])
    torch._dynamo.reset()
    counters.clear()
    with target.compiled_layers(backend="eager"):  # the plumbing; inductor is what runs on the GPU
        got = target.features(ids, [0, 1, 3])
        target.features(ids, [0, 1, 3])
    torch.testing.assert_close(got, ref)
    assert counters["stats"]["unique_graphs"] == 1  # 4 layers ran, twice: one graph
    assert all("forward" not in vars(layer) for layer in target.decoder.layers)


def test_keep_only_head_frees_the_layers_and_keeps_embedding_and_lm_head():
    """What a drafter-only worker keeps: the same embedding and LM head, no decoder layers."""
    full = load_target("random:tiny", device="cpu", seed=0)
    head = load_target("random:tiny", device="cpu", seed=0)
    layer_params = sum(p.numel() for p in head.decoder.layers.parameters())
    before = sum(p.numel() for p in head.model.parameters())
    head.keep_only_head(torch.device("cpu"))
    assert len(head.decoder.layers) == 0
    assert sum(p.numel() for p in head.model.parameters()) == before - layer_params
    ids = torch.tensor([[5, 9, 77]])
    torch.testing.assert_close(head.embed(ids), full.embed(ids), rtol=0, atol=0)
    h = torch.randn(1, 3, head.hidden_size)
    torch.testing.assert_close(head.lm_head(h), full.lm_head(h), rtol=0, atol=0)
    assert head.num_layers == full.num_layers  # the config still describes the target (compatibility checks)


def test_an_unreachable_hub_fails_at_once_with_one_line(monkeypatch):
    """No ~50 s of retries: one connect probe, then the local cache or a one-line error."""
    from dflash_train.errors import UsageError
    from dflash_train.models import loading

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(UsageError, match=r"^--target: someone/no-such-model: the hub is unreachable and the model "
                                         r"is not in the local cache"):
        loading.load_target("someone/no-such-model")


def test_more_kv_heads_start_as_the_targets_attention(tiny_target):
    """--num-key-value-heads above the target's (tiny: 4 query heads, 2 KV heads): each target K/V head is
    repeated for the query heads it served, so with every other weight equal the layers compute the same."""
    from dflash_train.models.drafter import ContextCache
    from dflash_train.models.factory import drafter_config_for, init_from_target, new_drafter

    def drafter(**kw):
        d = new_drafter(drafter_config_for(tiny_target, num_layers=2, block_size=4, dtype="float32", **kw)).float()
        init_from_target(d, tiny_target)
        return d.eval()

    base, wide = drafter(), drafter(num_key_value_heads=4)
    assert (base.config.num_key_value_heads, wide.config.num_key_value_heads) == (2, 4)
    assert wide.layers[0].self_attn.k_proj.weight.shape[0] == 2 * base.layers[0].self_attn.k_proj.weight.shape[0]
    with torch.no_grad():
        for name, p in wide.named_parameters():
            if "k_proj" not in name and "v_proj" not in name:
                p.copy_(base.get_parameter(name))
    g = torch.Generator().manual_seed(0)
    hidden = tiny_target.config.hidden_size
    block = torch.randn(1, 4, hidden, generator=g)
    feats = torch.randn(1, 9, hidden * len(base.config.target_layer_ids), generator=g)
    pos = torch.arange(13)[None]
    with torch.no_grad():
        want = base(block, feats, pos, cache=ContextCache())
        got = wide(block, feats, pos, cache=ContextCache())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_kv_heads_that_do_not_fit_are_refused_by_name(tiny_target):
    from dflash_train.models.factory import drafter_config_for, init_from_target, new_drafter

    with pytest.raises(UsageError, match="--num-key-value-heads must divide the target's 4 attention heads, got 3"):
        drafter_config_for(tiny_target, num_layers=1, block_size=4, num_key_value_heads=3)
    fewer = new_drafter(drafter_config_for(tiny_target, num_layers=1, block_size=4, num_key_value_heads=1))
    with pytest.raises(UsageError, match="--num-key-value-heads 1 is not a multiple of the target's 2 KV heads"):
        init_from_target(fewer, tiny_target)


def test_a_drafter_with_more_kv_heads_decodes_losslessly_and_as_the_training_layers(tiny_target, monkeypatch):
    """The decode's StaticDrafter reads the K/V head count from the drafter's config, as training's layers do."""
    from static_lm_checks import check_hf_verifier, check_lossless, prompts, tiny_drafter

    drafter = tiny_drafter(tiny_target, num_key_value_heads=4)
    check_lossless(tiny_target, drafter, prompts(2, seed=3, base=8))
    check_hf_verifier(tiny_target, drafter, prompts(1, seed=5, base=11)[0], monkeypatch)
