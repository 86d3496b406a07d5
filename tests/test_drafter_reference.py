"""Our DFlashDrafter against the authors' DFlashDraftModel (PyPI `dflash`): weights, outputs, caches."""

import pytest
import torch
from dflash import DFlashDraftModel
from transformers import DynamicCache

from dflash_train.models.checkpoint import load_drafter, save_drafter
from dflash_train.models.drafter import ContextCache

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _inputs(drafter, ctx_len=7, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    cfg = drafter.config
    feats = torch.randn(1, ctx_len, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    emb = torch.randn(1, cfg.block_size, cfg.hidden_size, generator=g)
    pos = torch.arange(ctx_len + cfg.block_size)[None]
    return feats, emb, pos


def _load_reference(path, dtype):
    ref, info = DFlashDraftModel.from_pretrained(str(path), dtype=dtype, output_loading_info=True)
    return ref.eval(), info


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_loads_our_checkpoint_and_matches(make_drafter, perturb_norms, tmp_path, dtype):
    ours = perturb_norms(make_drafter(num_layers=2))
    save_drafter(ours, tmp_path, dtype)
    ref, info = _load_reference(tmp_path, dtype)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert ref.target_layer_ids == ours.config.target_layer_ids
    assert ref.mask_token_id == ours.config.mask_token_id and ref.block_size == ours.config.block_size
    ours = load_drafter(tmp_path)
    assert next(ours.parameters()).dtype == dtype
    feats, emb, pos = _inputs(ours)
    with torch.no_grad():
        a = ours(emb.to(dtype), feats.to(dtype), pos)
        b = ref(position_ids=pos, noise_embedding=emb.to(dtype), target_hidden=feats.to(dtype))
    err = ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert err < TOL[dtype], err


def test_we_load_reference_checkpoint(make_drafter, tmp_path):
    """A checkpoint written by the reference model's own save_pretrained loads into ours, same outputs."""
    src = make_drafter(num_layers=3)
    save_drafter(src, tmp_path / "a", torch.float32)
    ref, _ = _load_reference(tmp_path / "a", torch.float32)
    with torch.no_grad():  # make the weights differ from ours so the test sees the reference's own
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "b")
    ours = load_drafter(tmp_path / "b")
    feats, emb, pos = _inputs(ours, gen_seed=3)
    with torch.no_grad():
        torch.testing.assert_close(ours(emb, feats, pos),
                                   ref(position_ids=pos, noise_embedding=emb, target_hidden=feats),
                                   rtol=1e-5, atol=1e-5)


def test_sliding_window_layers_match_reference(make_drafter, perturb_norms, tmp_path):
    ours = perturb_norms(make_drafter(num_layers=3, block_size=6, num_sliding_layers=2, sliding_window=4))
    save_drafter(ours, tmp_path, torch.float32)
    ref, _ = _load_reference(tmp_path, torch.float32)
    assert [layer.self_attn.sliding_window for layer in ref.layers] == [4, 4, None]
    feats, emb, pos = _inputs(ours, ctx_len=9)
    with torch.no_grad():
        torch.testing.assert_close(ours(emb, feats, pos),
                                   ref(position_ids=pos, noise_embedding=emb, target_hidden=feats),
                                   rtol=1e-5, atol=1e-5)


def test_context_cache_matches_reference_over_steps(make_drafter, perturb_norms, tmp_path):
    """Decode-style calls: new context each step, block K/V dropped; same outputs as the reference's cache."""
    ours = perturb_norms(make_drafter(num_layers=2, block_size=5))
    save_drafter(ours, tmp_path, torch.float32)
    ref, _ = _load_reference(tmp_path, torch.float32)
    cfg = ours.config
    n_feat = len(cfg.target_layer_ids) * cfg.hidden_size
    cache, ref_cache = ContextCache(), DynamicCache(config=ref.config)
    start, g = 0, torch.Generator().manual_seed(5)
    for new_ctx in (6, 3, 1, 5):  # tokens committed by the previous step
        feats = torch.randn(1, new_ctx, n_feat, generator=g)
        emb = torch.randn(1, cfg.block_size, cfg.hidden_size, generator=g)
        pos = torch.arange(start, start + new_ctx + cfg.block_size)[None]
        with torch.no_grad():
            a = ours(emb, feats, pos, cache=cache)
            b = ref(position_ids=pos, noise_embedding=emb, target_hidden=feats, past_key_values=ref_cache,
                    use_cache=True)
        ref_cache.crop(start + new_ctx)
        start += new_ctx
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert cache.length == start
