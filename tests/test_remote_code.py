"""The exported drafter through transformers' AutoModel + trust_remote_code (the file we ship in it)."""

import pytest
import torch
from dflash import DFlashDraftModel
from transformers import AutoModel

from dflash_train.decode.speculative import speculative_generate, target_generate
from dflash_train.models.chat import render_chat, stop_token_ids
from dflash_train.models.checkpoint import load_drafter, save_drafter
from dflash_train.models.drafter import ContextCache


def _auto(path):
    model, info = AutoModel.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32,
                                            output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == "DFlashDraftModel" and type(model).__module__.endswith("modeling_dflash")
    return model.eval()


@pytest.mark.parametrize("sliding", [False, True])
def test_automodel_loads_the_export_and_matches_ours_and_the_reference(make_drafter, perturb_norms, tmp_path, sliding):
    kw = {"num_sliding_layers": 1, "sliding_window": 4} if sliding else {}
    ours = perturb_norms(make_drafter(num_layers=3, block_size=6, **kw))
    save_drafter(ours, tmp_path, torch.float32)
    auto, ref = _auto(tmp_path), DFlashDraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    cfg = ours.config
    feats = torch.randn(1, 9, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    emb = torch.randn(1, cfg.block_size, cfg.hidden_size, generator=g)
    pos = torch.arange(9 + cfg.block_size)[None]
    with torch.no_grad():
        want = load_drafter(tmp_path)(emb, feats, pos)
        got = auto(position_ids=pos, noise_embedding=emb, target_hidden=feats)
        theirs = ref(position_ids=pos, noise_embedding=emb, target_hidden=feats)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)


def test_automodel_context_cache_matches_ours_over_steps(make_drafter, perturb_norms, tmp_path):
    """Decode-style calls (new context each step, block K/V dropped) agree with our ContextCache."""
    from importlib import import_module

    ours = perturb_norms(make_drafter(num_layers=2, block_size=5, num_sliding_layers=1, sliding_window=6))
    save_drafter(ours, tmp_path, torch.float32)
    auto = _auto(tmp_path)
    remote_cache = import_module(type(auto).__module__).DFlashContextCache()
    cache, g, start = ContextCache(), torch.Generator().manual_seed(2), 0
    n_feat, B, H = len(ours.config.target_layer_ids) * 64, 5, 64
    for new in (7, 3, 1, 4):
        feats = torch.randn(1, new, n_feat, generator=g)
        emb = torch.randn(1, B, H, generator=g)
        pos = torch.arange(start, start + new + B)[None]
        with torch.no_grad():
            torch.testing.assert_close(auto(pos, emb, feats, past_key_values=remote_cache),
                                       ours(emb, feats, pos, cache=cache), rtol=1e-5, atol=1e-5)
        start += new


def test_spec_generate_is_lossless_and_equals_our_decode_loop(tiny_target, make_drafter, perturb_norms, tmp_path):
    drafter = perturb_norms(make_drafter(num_layers=2, block_size=4))
    save_drafter(drafter, tmp_path, torch.float32)
    auto = _auto(tmp_path)
    prompt = render_chat(tiny_target, [{"role": "user", "content": "count to ten"}])
    stops = stop_token_ids(tiny_target)
    out = auto.spec_generate(tiny_target.model, torch.tensor([prompt]), max_new_tokens=20, stop_token_ids=stops)
    tokens = out[0, len(prompt):].tolist()
    assert tokens == target_generate(tiny_target, prompt, 20, stop_ids=stops).tokens
    assert tokens == speculative_generate(tiny_target, drafter, prompt, 20, stop_ids=stops).tokens


def test_spec_generate_accepts_whole_blocks_from_an_oracle_drafter(make_drafter, tmp_path):
    """All-zero logits on both sides (final norms zeroed): every draft is token 0, the target's choice too."""
    from dflash_train.models.loading import load_target

    target = load_target("random:tiny", seed=1)
    target.decoder.norm.weight.data.zero_()
    drafter = make_drafter(num_layers=1, block_size=5)
    drafter.norm.weight.data.zero_()
    save_drafter(drafter, tmp_path, torch.float32)
    counts = []
    out = _auto(tmp_path).spec_generate(target.model, torch.tensor([list(range(3, 15))]), max_new_tokens=21,
                                        accepted_counts=counts)
    assert out[0, 12:].tolist() == [0] * 21 and counts == [4] * 4  # 1 from prefill + 4 steps of 4 drafts + 1
