"""A check that StaticLM's prefill and steps compute HF's forward (tests/test_static_lm*.py share it)."""

import torch

from dflash_train.decode import static_lm
from dflash_train.decode.static_lm import StaticLM


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
