"""Checks that StaticLM and the decode loops on it compute what transformers does (tests/test_static_lm*.py
share them): prefill and steps against HF's forward, batched and batch-1 greedy decodes against HF's generate,
DFlash lossless and step for step as the loop that verifies through HF's forward."""

import torch

from dflash_train.decode import speculative as spec
from dflash_train.decode import static_lm
from dflash_train.decode.generate import generate
from dflash_train.decode.static_lm import StaticLM
from dflash_train.eval.evaluate import EvalConfig, evaluate
from dflash_train.models.factory import drafter_config_for, new_drafter


def prompts(n: int, seed: int = 0, base: int = 3) -> list[list[int]]:
    """n prompts of unequal lengths (base, base + 7, ...): from under a tiny window to several windows long."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (base + 7 * i,), generator=g).tolist() for i in range(n)]


def tiny_drafter(target, **kw):
    """An untrained 2-layer B=4 drafter for `target`, float32, eval mode."""
    cfg = drafter_config_for(target, num_layers=2, block_size=4, dtype="float32", **kw)
    return new_drafter(cfg, 1).float().eval()


def check_prefill_and_steps(target, prompts: list[list[int]], layers: tuple[int, ...], blocks: tuple[int, ...],
                            prefill: bool) -> None:
    """A padded batched prefill of `prompts`, then steps of `blocks` tokens each (each row continuing from its
    own length): logits and the `layers`' features as HF's forward over the whole sequence, within 1e-5."""
    lm, model = StaticLM(target.model), target.model
    n = len(prompts)
    cache = lm.cache_for(n, 64)
    width = max(map(len, prompts))
    ids = torch.zeros(n, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    last = torch.tensor([len(p) - 1 for p in prompts])
    out = lm.forward(ids, torch.arange(width).expand(n, width), cache, static_lm.bucket(width), layers=layers,
                     logits="last", last=last, prefill=prefill)
    for i, p in enumerate(prompts):
        ref = model(torch.tensor([p]), output_hidden_states=True)
        torch.testing.assert_close(out.logits[i, 0], ref.logits[0, -1], rtol=0, atol=1e-5)
        want = torch.cat([ref.hidden_states[j + 1] for j in layers], dim=-1)[0]
        torch.testing.assert_close(out.features[i, :len(p)], want, rtol=0, atol=1e-5)
    seqs = [list(p) for p in prompts]
    for q in blocks:
        new = torch.randint(0, 256, (n, q))
        pos = torch.tensor([len(s) for s in seqs])[:, None] + torch.arange(q)
        step = lm.step(new, pos, cache, static_lm.bucket(int(pos.max()) + 1), layers=layers)
        for i, s in enumerate(seqs):
            s += new[i].tolist()
            ref = model(torch.tensor([s]), output_hidden_states=True)
            torch.testing.assert_close(step.logits[i], ref.logits[0, -q:], rtol=0, atol=1e-5)
            want = torch.cat([ref.hidden_states[j + 1] for j in layers], dim=-1)[0, -q:]
            torch.testing.assert_close(step.features[i], want, rtol=0, atol=1e-5)


def hf_greedy_rows(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's n greedy tokens by transformers' generate, one prompt at a time."""
    device = next(model.parameters()).device
    out = []
    for p in prompts:
        ref = model.generate(torch.tensor([p], device=device), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        out.append(ref[0, len(p):].tolist())
    return out


def check_batched_generate(target, prompts: list[list[int]]) -> None:
    """Regeneration's batched decode: each row's tokens are transformers' greedy generate's."""
    assert generate(StaticLM(target.model), prompts, 16, [], lag=0).rows == hf_greedy_rows(target.model, prompts, 16)


def check_target_generate(target, prompts: list[list[int]]) -> None:
    """The batch-1 target-only decode: HF's greedy tokens."""
    for p in prompts:
        assert spec.target_generate(target, p, 20).tokens == spec.hf_target_generate(target, p, 20).tokens


def check_lossless(target, drafter, prompts: list[list[int]]) -> None:
    """T=0 DFlash: the device loop's tokens are the target's greedy ones."""
    rep = evaluate(target, drafter, prompts, EvalConfig(max_new_tokens=20), progress=False)
    assert rep.lossless == "exact" and rep.mismatched_prompts == [] and rep.divergences == []


def check_hf_verifier(target, drafter, prompt: list[int], monkeypatch, **kw) -> None:
    """DFlash step for step as the loop that verifies through HF's forward and its DynamicCache."""
    ours = spec.speculative_generate(target, drafter, prompt, 18, **kw)
    monkeypatch.setattr(static_lm, "for_model", lambda model: None)  # force HF's forward
    theirs = spec.speculative_generate(target, drafter, prompt, 18)
    assert ours.tokens == theirs.tokens and len(ours.tokens) == 18
    assert (ours.committed, ours.accepted, ours.slots) == (theirs.committed, theirs.accepted, theirs.slots)


def check_graph_replays(model, prompts: list[list[int]]) -> None:
    """On the GPU: graph replays give the eager steps' tokens, and those transformers' greedy ones."""
    eager = generate(StaticLM(model, graphs=False), prompts, 16, [], lag=0).rows
    graphed = StaticLM(model, graphs=True)
    assert graphed.graphs
    assert generate(graphed, prompts, 16, []).rows == eager
    assert eager == hf_greedy_rows(model, prompts, 16)
