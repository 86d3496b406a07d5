"""StaticLM (static KV cache, CUDA graphs on GPU) computes HF's forward, and every decode loop on it
gives the tokens of the HF-forward loops: regeneration, the target-only baseline, DFlash decoding."""

import pytest
import torch
from static_lm_checks import check_prefill_and_steps

from dflash_train.data import regenerate as regen
from dflash_train.data.regenerate import RegenConfig
from dflash_train.decode import speculative as spec
from dflash_train.decode import static_lm
from dflash_train.decode.generate import generate, until_stop
from dflash_train.decode.static_lm import StaticLM
from dflash_train.models.loading import byte_tokenizer
from dflash_train.models.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls (conftest)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(3)
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request, tiny_target):
    if request.param == "qwen3":
        return tiny_target
    return Target(model=_llama(), tokenizer=byte_tokenizer(), spec="llama-test")


def _prompts(n, seed=0, base=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (base + 3 * i,), generator=g).tolist() for i in range(n)]


def test_supports_the_families_of_the_table_only(tiny_target):
    """Llama-family decoders with or without sliding layers (tests/test_static_lm_sliding.py); not GPT-2."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    assert static_lm.supports(tiny_target.model) and static_lm.supports(_llama())
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert static_lm.supports(Qwen2ForCausalLM(cfg))
    assert not static_lm.supports(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)))


@torch.no_grad()
@pytest.mark.parametrize("prefill", [False, True], ids=["masked", "causal"])
def test_prefill_and_steps_equal_hf_forward(target, prefill):
    """Padded batched prefill (through the general mask, or SDPA's causal kernel as `prefill=True`
    runs it), then decode steps, then a 4-token block: logits and features as HF's."""
    check_prefill_and_steps(target, _prompts(3), (0, target.num_layers - 1), (1, 1, 1, 4), prefill)


def test_regeneration_equals_hf_loop(target):
    prompts = _prompts(4, seed=1)
    cfg = RegenConfig(max_new_tokens=12)
    stops = [int(regen._hf_generate(target, prompts[:1], cfg, [])[0][5])]  # a token row 0 emits: rows stop
    ours = regen._generate(target, prompts, cfg, stops)
    theirs = regen._replies(target.tokenizer, regen._hf_generate(target, prompts, cfg, stops), set(stops),
                            cfg.max_new_tokens)
    assert [r.ids for r in ours] == [r.ids for r in theirs]
    assert [r.hit_limit for r in ours] == [r.hit_limit for r in theirs]
    assert not ours[0].hit_limit and ours[0].ids[-1] == stops[0]


def test_generate_reads_the_stop_check_lag_steps_late(target):
    """A stop check read `lag` steps late decodes exactly `lag` steps past the stop, which the caller
    cuts: the kept tokens are those of a check read at once."""
    lm = static_lm.for_model(target.model)
    prompt = _prompts(1, seed=2)[0]
    free = generate(lm, [prompt], 12, []).rows[0]
    stop = free[3]
    first = free.index(stop) + 1  # tokens up to and including the first stop
    at_once = generate(lm, [prompt], 12, [stop], lag=0).rows[0]
    late = generate(lm, [prompt], 12, [stop], lag=2).rows[0]
    assert len(at_once) == first and len(late) == first + 2
    assert until_stop(late, {stop}) == at_once == free[:first]


def test_prefill_chunks_pad_to_their_own_width(target, monkeypatch):
    """Prefill chunks of a batch sorted by length, each padded to its own longest row rather than the batch's:
    a long last prompt no longer pads every row, and every row decodes what it decodes alone."""
    from dflash_train.decode import generate as gen

    assert gen.prefill_chunks([]) == []
    monkeypatch.setattr(gen, "PREFILL_TOKENS", 64)
    lengths = [5, 6, 8, 9, 30, 60]
    assert gen.prefill_chunks(lengths) == [(0, 4), (4, 5), (5, 6)]  # 4 x 9 fits 64 tokens; 30 and 60 alone
    assert gen.prefill_chunks([100, 3]) == [(0, 1), (1, 2)]  # a row longer than the budget is a chunk alone
    lm = static_lm.for_model(target.model)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    together = generate(lm, prompts, 6, []).rows
    assert together == [generate(lm, [p], 6, []).rows[0] for p in prompts]


def test_a_repeated_prompt_is_prefilled_once_and_decodes_as_its_first(target, monkeypatch):
    """Samples of one conversation share their first prompt: it is computed once, its K/V copied to the
    repeats' rows, and every row decodes what it decodes alone."""
    lm = static_lm.for_model(target.model)
    g = torch.Generator().manual_seed(6)
    a, b, c = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 11, 9))
    prompts = [a, a, b, c, b, c, c]
    alone = {tuple(p): generate(lm, [p], 6, []).rows[0] for p in (a, b, c)}
    rows_prefilled, forward = [], lm.forward

    def counted(ids, *args, **kwargs):
        rows_prefilled.append(len(ids))
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(lm, "forward", counted)
    out = generate(lm, prompts, 6, [])
    assert sum(rows_prefilled[:1]) == 3  # the prefill: three distinct prompts (the steps come after)
    assert out.rows == [alone[tuple(p)] for p in prompts]


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_dropping_finished_rows_keeps_every_rows_tokens(target, monkeypatch, lag):
    """A batch that compacts whenever a row has stopped gives each row the tokens of a batch that never
    does (cut at the first stop): rows that stop after a compaction, and the longest prompt's row
    stopping early (the width shrinks), with the stop count read at once or late."""
    from dflash_train.decode import generate as gen

    lm = static_lm.for_model(target.model)
    prompts = _prompts(6, seed=5)
    free = generate(lm, prompts, 16, []).rows
    stops = _staggered_stops(free, longest=max(range(6), key=lambda i: len(prompts[i])))
    monkeypatch.setattr(gen, "bucket", lambda n: n)  # no rounding up of key lengths to hide a short span
    monkeypatch.setattr(gen, "COMPACT_MIN_ROWS", 1)
    monkeypatch.setattr(gen, "COMPACT_MIN_SHARE", 0.0)
    compacted = generate(lm, prompts, 16, stops, lag=lag)
    assert compacted.compactions >= 1
    assert [until_stop(r, set(stops)) for r in compacted.rows] == [until_stop(r, set(stops)) for r in free]


def test_compaction_when_the_last_rows_stop_after_the_count_was_read(tiny_target, monkeypatch):
    """Two rows stopping at consecutive steps: the count read one step late says one row runs, the
    compaction finds none, and the batch ends with both rows' tokens (the qwen3 tiny target: the
    llama one repeats one token per row)."""
    from dflash_train.decode import generate as gen

    lm = static_lm.for_model(tiny_target.model)
    prompts = _prompts(6, seed=5)
    free = generate(lm, prompts, 16, []).rows
    pair = next(((i, j, [free[i][t], free[j][t + 1]]) for i in range(6) for j in range(6) for t in range(1, 12)
                 if i != j and _ends(free[i], free[j], {free[i][t], free[j][t + 1]}) == (t, t + 1)), None)
    assert pair, f"no rows stopping at consecutive steps in {free}"
    i, j, stops = pair
    monkeypatch.setattr(gen, "COMPACT_MIN_ROWS", 1)
    monkeypatch.setattr(gen, "COMPACT_MIN_SHARE", 0.0)
    out = generate(lm, [prompts[i], prompts[j]], 16, stops, lag=1)
    assert [until_stop(r, set(stops)) for r in out.rows] == [until_stop(r, set(stops)) for r in (free[i], free[j])]


def _ends(a: list[int], b: list[int], stops: set[int]) -> tuple:
    return _first_stop(a, stops), _first_stop(b, stops)


def _first_stop(row: list[int], stops: set[int]) -> int | None:
    return next((k for k, t in enumerate(row) if t in stops), None)


def _staggered_stops(rows: list[list[int]], longest: int) -> list[int]:
    """Two stop tokens under which the rows stop at two or more different steps, row `longest` early,
    and one row never does. Greedy random models repeat a token for long stretches: search."""
    tokens = sorted({t for r in rows for t in r})
    for a in tokens:
        for b in tokens:
            e = [_first_stop(r, {a, b}) for r in rows]
            stopped = [i for i in e if i is not None]
            if None in e and len(set(stopped)) >= 2 and e[longest] is not None and e[longest] < len(rows[longest]) - 2:
                return [a, b]
    raise AssertionError(f"no staggered stops in {rows}")


def test_target_generate_equals_hf(target):
    for p in _prompts(2, seed=3):
        ours = spec.target_generate(target, p, 20, stop_ids=[9])
        theirs = spec.hf_target_generate(target, p, 20, stop_ids=[9])
        assert ours.tokens == theirs.tokens


@pytest.mark.parametrize("max_new", [13, 16])  # 13: the last block is cut short by the token limit
def test_speculative_equals_hf_verifier(tiny_target, make_drafter, monkeypatch, max_new):
    drafter = make_drafter(block_size=4)
    prompt = _prompts(1, seed=4, base=11)[0]
    ours = spec.speculative_generate(tiny_target, drafter, prompt, max_new)
    monkeypatch.setattr(static_lm, "for_model", lambda model: None)  # force HF's forward
    theirs = spec.speculative_generate(tiny_target, drafter, prompt, max_new)
    assert ours.tokens == theirs.tokens and len(ours.tokens) == max_new
    assert (ours.committed, ours.accepted, ours.slots) == (theirs.committed, theirs.accepted, theirs.slots)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_equal_eager():
    from dflash_train.models.loading import load_target

    t = load_target("random:tiny", device="cuda", dtype=torch.float32, seed=0)
    eager, graphed = StaticLM(t.model, graphs=False), StaticLM(t.model, graphs=True)
    prompts = _prompts(5, seed=5)
    a = generate(eager, prompts, 24, [], lag=0).rows
    b = generate(graphed, prompts, 24, []).rows
    assert a == b


@pytest.mark.parametrize("heads", [(4, 1, 256), (9, 3, 64)])  # Gemma 3 270M's, SmolLM2's
@pytest.mark.parametrize("length", [64, 65, 200, 424])
def test_the_causal_prefill_matches_float64_at_the_targets_head_shapes(heads, length):
    """StaticLM's prefill attention in bf16 (SDPA's flash kernel with grouped heads on CUDA) against float64,
    past one 64-row tile and at real prompt lengths: a wrong prefill skews every prompt feature the drafter sees."""
    H, Hkv, d = heads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, h, length, d, generator=gen) for h in (H, Hkv, Hkv))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(H // Hkv, 1), v.double().repeat_interleave(H // Hkv, 1),
        is_causal=True, scale=d ** -0.5)
    got = static_lm.causal_attention(*(x.to(device, torch.bfloat16) for x in (q, k, v)), d ** -0.5)
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=0.05)
