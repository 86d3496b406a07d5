"""Speculative decoding: lossless at T=0, oracle tau = B, the reference loop's behaviour, exact sampling."""

import pytest
import torch

from dflash_train.decode import greedy_loop, static_drafter, static_lm
from dflash_train.decode.speculative import compile_decode, rejection_sample, speculative_generate, target_generate
from dflash_train.eval.evaluate import EvalConfig, evaluate
from dflash_train.models.checkpoint import save_drafter
from dflash_train.models.factory import drafter_config_for, new_drafter
from dflash_train.models.loading import load_target


def _prompts(n, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length + i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def oracle_target():
    """A target whose logits are all zero (final norm weight 0), so its greedy choice is always token 0."""
    t = load_target("random:tiny", seed=1)
    t.decoder.norm.weight.data.zero_()
    return t


def _oracle_drafter(make_drafter, **kw):
    d = make_drafter(**kw)
    d.norm.weight.data.zero_()  # zero logits -> always drafts token 0, exactly what the oracle target wants
    return d


def test_greedy_random_drafter_is_lossless_and_tau_near_one(tiny_target, make_drafter):
    drafter = make_drafter(num_layers=1, block_size=4)
    rep = evaluate(tiny_target, drafter, _prompts(3), EvalConfig(max_new_tokens=24), progress=False)
    assert rep.lossless == "exact" and rep.mismatched_prompts == [] and rep.divergences == []
    assert 1.0 <= rep.tau < 1.2
    assert sum(rep.histogram) == rep.steps and len(rep.per_position_acceptance) == 3
    assert list(rep.phases_s) == ["warm-up", "decode", "checks"] and rep.phases_s["decode"] > 0  # no replay given
    assert "eval wall time:             warm-up" in rep.summary()


def test_a_divergence_records_the_targets_logit_gap_and_ties_are_told_from_errors(tiny_target):
    """The first differing token, both tokens and the target's gap between them on the shared prefix."""
    from dflash_train.eval.evaluate import divergence, lossless_status

    prompt = _prompts(1)[0]
    base = target_generate(tiny_target, prompt, 8).tokens
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([prompt + base[:3]])).logits[0, -1]
    ranked = logits.argsort(descending=True)
    assert ranked[0] == base[3]
    for other, want in ((int(ranked[1]), "ties-only"), (int(ranked[-1]), "mismatch")):
        dflash = base[:3] + [other] + base[4:]
        d = divergence(tiny_target, prompt, 5, dflash, base)
        assert (d.prompt, d.position, d.target_token, d.dflash_token) == (5, 3, base[3], other)
        assert d.gap == pytest.approx(float(logits[base[3]] - logits[other]), abs=1e-5)
        assert d.top2_margin == pytest.approx(float(logits[ranked[0]] - logits[ranked[1]]), abs=1e-5)
        # a tie threshold just above the top-2 gap: the runner-up is a tie, the last token is not
        assert lossless_status([d], tie_gap=d.top2_margin + 1e-6 if want == "ties-only" else 1e-3) == want
    assert lossless_status([], tie_gap=0.0) == "exact"


def test_oracle_drafter_reaches_tau_equal_block_size(oracle_target, make_drafter):
    B = 5
    drafter = _oracle_drafter(make_drafter, block_size=B)
    res = speculative_generate(oracle_target, drafter, _prompts(1)[0], max_new_tokens=1 + 4 * B)
    assert res.committed == [B] * 4 and res.accepted == [B - 1] * 4
    assert res.tokens == target_generate(oracle_target, _prompts(1)[0], 1 + 4 * B).tokens == [0] * (1 + 4 * B)
    rep = evaluate(oracle_target, drafter, _prompts(2), EvalConfig(max_new_tokens=1 + 3 * B), progress=False)
    assert rep.tau == B and rep.per_position_acceptance == [1.0] * (B - 1) and rep.lossless == "exact"


def test_oracle_at_temperature_accepts_everything(oracle_target, make_drafter):
    """p == q (both uniform): rejection sampling must accept every draft."""
    B = 4
    drafter = _oracle_drafter(make_drafter, block_size=B)
    gen = torch.Generator().manual_seed(0)
    res = speculative_generate(oracle_target, drafter, _prompts(1)[0], 1 + 5 * B, temperature=1.0, gen=gen)
    assert res.committed == [B] * 5


def test_stop_token_ends_generation(oracle_target, make_drafter):
    drafter = _oracle_drafter(make_drafter, block_size=4)
    res = speculative_generate(oracle_target, drafter, _prompts(1)[0], 40, stop_ids=[0])
    assert res.tokens == [0]  # the first token (from prefill) is already a stop token
    base = target_generate(oracle_target, _prompts(1)[0], 40, stop_ids=[0])
    assert base.tokens == [0]


@pytest.mark.parametrize("oracle", [False, True])
def test_same_tokens_and_acceptance_as_reference_loop(tiny_target, oracle_target, make_drafter, reference_timing,
                                                      tmp_path, oracle):
    from dflash import DFlashDraftModel

    target = oracle_target if oracle else tiny_target
    drafter = _oracle_drafter(make_drafter, block_size=4) if oracle else make_drafter(block_size=4)
    save_drafter(drafter, tmp_path, torch.float32)
    ref = DFlashDraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    prompt = _prompts(1, length=15)[0]
    ours = speculative_generate(target, drafter, prompt, max_new_tokens=30)
    theirs = reference_timing.dflash_generate(ref, target.model, torch.tensor([prompt]), 30, None, return_stats=True)
    assert theirs.output_ids[0, len(prompt):].tolist() == ours.tokens
    assert theirs.acceptance_lengths == ours.committed


def _chi2(counts, probs):
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_reproduces_target_distribution():
    """Committed tokens follow p, whatever q proposes (chi-square, V=5, 0.999 quantile 18.47 for 4 dof)."""
    V, n, trials = 5, 3, 20000
    g = torch.Generator().manual_seed(1234)
    p = torch.distributions.Dirichlet(torch.ones(V)).sample((n + 1,))
    q = torch.distributions.Dirichlet(torch.ones(V)).sample((n,))
    first = torch.zeros(V)
    second = torch.zeros(V)
    for _ in range(trials):
        draft = torch.multinomial(q, 1, generator=g)[:, 0]
        acc, nxt = rejection_sample(draft, q, p, g)
        committed = draft[:acc].tolist() + [nxt]
        first[committed[0]] += 1
        if acc >= 1:  # the first draft was accepted: the second token must follow p[1]
            second[committed[1]] += 1
    assert _chi2(first, p[0]) < 18.47
    assert _chi2(second, p[1]) < 18.47
    # The test has power: the draft distribution itself is far from p.
    assert _chi2(first, q[0]) > 100


def test_rejection_sampling_identical_distributions_accept_all():
    V = 7
    p = torch.softmax(torch.randn(4, V), -1)
    draft = torch.tensor([1, 2, 3])
    acc, _ = rejection_sample(draft, p[:3], p, torch.Generator().manual_seed(0))
    assert acc == 3


def _partial_pair(device="cpu"):
    """An oracle target (always token 0) and a drafter that drafts 0 in some slots only: token 0's
    LM-head row is a large random direction, so a slot drafts 0 when its hidden state leans that way.
    With these seeds the steps accept 0, 2 and 4 of 4 drafts, and the last block is cut short."""
    t = load_target("random:tiny", device=device, seed=1, dtype=torch.float32)
    t.decoder.norm.weight.data.zero_()
    drafter = new_drafter(drafter_config_for(t, num_layers=2, block_size=5, dtype="float32"), 5).float().eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.mul_(1 + torch.randn(p.shape, generator=g))
        W = t.lm_head.weight
        W[0] = (torch.randn(W.shape[1], generator=g) * 30 * W[1:].norm(dim=1).mean().cpu() / W.shape[1] ** 0.5)
    return t, drafter.to(device), torch.randint(0, 256, (12,), generator=g).tolist()


@pytest.fixture(scope="module")
def partial_pair():
    return _partial_pair()


@pytest.mark.parametrize("lag", [0, 2])  # 2: records read two steps late, as on CUDA (where it is 1)
@pytest.mark.parametrize("max_new", [40, 23, 2])
def test_the_device_loop_takes_the_host_loops_steps(partial_pair, max_new, lag):
    """T=0 on a StaticLM target: the device-state loop commits, accepts and counts exactly what the host
    loop does, and queues no step past the token limit however late it reads."""
    target, drafter, prompt = partial_pair
    loop = greedy_loop.for_pair(target, drafter)
    loop.lag = lag
    try:
        ours = speculative_generate(target, drafter, prompt, max_new)
    finally:
        loop.lag = None
    host = speculative_generate(target, drafter, prompt, max_new, device_loop=False)
    assert (ours.tokens, ours.committed, ours.accepted, ours.slots) == (host.tokens, host.committed, host.accepted,
                                                                         host.slots)
    assert loop.queued == len(ours.committed)
    if max_new == 40:
        assert {0, 2, 4} <= set(ours.accepted) and ours.slots[-1] < 4  # partial, full and cut-short steps


def test_the_device_loop_starts_each_block_at_the_last_committed_token():
    """A target that alternates 0, 1, 0, ... (its layers add nothing; token 0 maps to 1, any other to 0)
    and a drafter that always drafts 0: after the first block (which starts at 0), every step
    accepts one draft, and only if the next block starts at the token the target committed last."""
    t = load_target("random:tiny", seed=2, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, t.hidden_size, generator=g)
    b -= (a @ b) / (a @ a) * a  # orthogonal: token 0's and the others' embeddings score apart
    with torch.no_grad():
        for layer in t.decoder.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        E, W = t.model.get_input_embeddings().weight, t.lm_head.weight
        E[:] = a
        E[0] = b
        W.mul_(0.01)
        W[0], W[1] = a, b
    drafter = new_drafter(drafter_config_for(t, num_layers=1, block_size=5, dtype="float32"), 0).float().eval()
    drafter.norm.weight.data.zero_()  # zero logits: drafts token 0 everywhere
    prompt = _prompts(1)[0]
    for device_loop in (True, False):
        res = speculative_generate(t, drafter, prompt, 21, device_loop=device_loop)
        assert res.tokens == [0, 1] * 10 + [0] and res.accepted == [0] + [1] * 10


def test_a_released_drafter_is_freed_with_its_decode_engines(tiny_target, make_drafter):
    """The loop and engine registries are weak-keyed, but their values hold the drafter: release lets go."""
    import gc
    import weakref

    drafter = make_drafter(block_size=4)
    speculative_generate(tiny_target, drafter, _prompts(1, seed=3)[0], 8)
    alive = weakref.ref(drafter)
    greedy_loop.release(drafter)
    del drafter
    gc.collect()
    assert alive() is None


def test_the_device_loop_stops_at_a_stop_token(tiny_target, make_drafter):
    drafter = make_drafter(block_size=4)
    prompt = _prompts(1, seed=3)[0]
    base = target_generate(tiny_target, prompt, 30).tokens
    stop = base[9]
    want = base[:base.index(stop) + 1]
    for device_loop in (True, False):
        got = speculative_generate(tiny_target, drafter, prompt, 30, stop_ids=[stop], device_loop=device_loop)
        assert got.tokens == want
    loop = greedy_loop.for_pair(tiny_target, drafter)
    loop.lag = 2  # a stop is seen two steps late: at most two steps run past it, and change nothing
    try:
        res = speculative_generate(tiny_target, drafter, prompt, 30, stop_ids=[stop])
    finally:
        loop.lag = None
    assert res.tokens == want and 0 < loop.queued - len(res.committed) <= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_graphed_device_loop_takes_the_host_loops_steps():
    """On CUDA the device loop replays one graph per step and reads each step back a step late; its
    graphs are reused by a decode with another token limit (the limit is state, not a constant)."""
    target, drafter, prompt = _partial_pair("cuda")
    for max_new in (40, 23, 150, 23):
        ours = speculative_generate(target, drafter, prompt, max_new)
        host = speculative_generate(target, drafter, prompt, max_new, device_loop=False)
        assert (ours.tokens, ours.committed, ours.accepted, ours.slots) == (host.tokens, host.committed,
                                                                             host.accepted, host.slots)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_compiled_drafter_beside_the_eager_target_takes_the_eager_steps(device):
    """compile_decode(target_steps=False): the drafter's steps compiled, the target's as without it (what the
    baseline runs); the device and host loops commit what the eager decode did."""
    target, drafter, prompt = _partial_pair(device)
    want = speculative_generate(target, drafter, prompt, 40)
    assert compile_decode(target, drafter, target_steps=False)
    lm = static_lm.for_model(target.model)
    assert not lm.compiled and static_drafter.for_drafter(drafter, target.model.get_input_embeddings(),
                                                          target.lm_head).compiled
    for device_loop in (True, False):
        ours = speculative_generate(target, drafter, prompt, 40, device_loop=device_loop)
        assert (ours.tokens, ours.committed, ours.accepted) == (want.tokens, want.committed, want.accepted)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_compiled_decode_steps_take_the_eager_steps(device):
    """compile_decode: the target's token steps and verifies and the drafter's steps run through
    torch.compile over the whole cache (one shape each); every decode commits what the eager one did."""
    from torch._dynamo.utils import counters

    target, drafter, prompt = _partial_pair(device)
    want = {m: speculative_generate(target, drafter, prompt, m) for m in (40, 23)}
    base = target_generate(target, prompt, 30).tokens
    frames = counters["stats"]["unique_graphs"]
    assert compile_decode(target, drafter)
    for max_new, device_loop in ((40, True), (23, False), (23, True)):
        ours, eager = speculative_generate(target, drafter, prompt, max_new, device_loop=device_loop), want[max_new]
        assert (ours.tokens, ours.committed, ours.accepted, ours.slots) == (eager.tokens, eager.committed,
                                                                             eager.accepted, eager.slots)
    assert target_generate(target, prompt, 30).tokens == base
    assert counters["stats"]["unique_graphs"] > frames  # the steps did run compiled
    # Later decodes (another prompt, other limits) reuse what was compiled: no compile per prompt.
    frames = counters["stats"]["unique_graphs"]
    other = prompt[::-1]
    speculative_generate(target, drafter, other, 33)
    speculative_generate(target, drafter, other, 17, device_loop=False)
    target_generate(target, other, 20)
    assert counters["stats"]["unique_graphs"] == frames


def test_the_warm_up_reaches_every_bucket_of_prompt_lengths():
    """The longest prompt first (it sizes the caches), then the shortest of each other 128-token bucket of the
    prompt and of the drafter's pass over its first L - B tokens."""
    from dflash_train.eval.evaluate import warm_prompts

    prompts = [[0] * n for n in (93, 321, 150, 100, 129, 300, 260)]
    # 129 and 260: the prompt in a bucket above its first 121 / 252 tokens' pass at B=8
    assert [len(p) for p in warm_prompts(prompts, 8, 128)] == [321, 93, 129, 150, 260]
    assert [len(p) for p in warm_prompts([[1] * 5], 8, 128)] == [5]
    # one prompt bucket, but 125's first DFlash step (125 + 8 keys) starts a bucket above 120's
    assert [len(p) for p in warm_prompts([[0] * 120, [0] * 125], 8, 128)] == [125, 120]
    # the same first keys, but at the token limit 250's decode reaches 384 keys where 140's stays within 256
    assert [len(p) for p in warm_prompts([[0] * 140, [0] * 250], 8, 100)] == [250, 140]
