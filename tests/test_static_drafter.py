"""The graphed drafter step computes what the eager drafter computes, step after step."""

import pytest
import torch

from dflash_train.decode.static_drafter import StaticDrafter
from dflash_train.decode.static_lm import bucket
from dflash_train.models.drafter import ContextCache


@pytest.mark.parametrize("sliding", [0, 1])
def test_static_steps_match_the_eager_drafter(tiny_target, make_drafter, perturb_norms, sliding):
    """A prompt, then full-width steps committing 1..B tokens (the rest of each step's B feature
    rows are rejected slots: random here, so a leak would show), then a last block cut short to
    2 slots (given B wide: its other slots are random too)."""
    B, H = 4, tiny_target.hidden_size
    drafter = perturb_norms(make_drafter(num_layers=2, block_size=B, num_sliding_layers=sliding, sliding_window=6))
    n_feat = len(drafter.config.target_layer_ids)
    embed, head = tiny_target.model.get_input_embeddings(), tiny_target.lm_head
    engine = StaticDrafter(drafter, embed, head)
    cache, eager_cache = engine.cache_for(64), ContextCache()
    g = torch.Generator().manual_seed(0)
    ctx_start, rows, n = 0, 11, 11  # the prompt: all of its rows are context
    for step, (next_n, width) in enumerate([(3, B), (1, B), (4, B), (2, B), (2, 2)]):
        feats = torch.randn(1, rows, n_feat * H, generator=g)
        block = torch.randint(0, 200, (1, B), generator=g)
        start = ctx_start + n
        positions = torch.arange(ctx_start, start + width)[None]
        with torch.no_grad():
            hidden = drafter(embed(block[:, :width]), feats[:, :n], positions, cache=eager_cache)
            want = head(hidden[:, 1:])[0]
        meta = torch.tensor([ctx_start, n, width])
        got = engine.step(feats, block, meta, cache, bucket(start + B))[:width - 1]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"step {step}")
        ctx_start, rows, n = start, B, next_n


def test_the_engine_and_its_cache_are_reused_across_prompts(tiny_target, make_drafter):
    from dflash_train.decode.static_drafter import for_drafter

    drafter = make_drafter(num_layers=1, block_size=4)
    embed, head = tiny_target.model.get_input_embeddings(), tiny_target.lm_head
    engine = for_drafter(drafter, embed, head)
    assert for_drafter(drafter, embed, head) is engine
    cache = engine.cache_for(100)
    assert engine.cache_for(300) is cache and cache.capacity == 1024  # capacity rounds up to 1024 slots
    assert engine.cache_for(2000) is not cache
