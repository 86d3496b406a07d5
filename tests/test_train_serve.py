"""Training sees what serving sees: the training path's block outputs equal a decode-style forward.

For every anchor of a packed batch, the drafter's output on the block during training (target
features of the whole packed row under a document mask, all blocks at once under the DFlash
mask) must equal what the decode loop computes at that point: the target's features of the
true prefix alone, then the drafter on [x_a, MASK x (B-1)] at positions a..a+B-1. Label offsets,
`<=` vs `<` in the context mask, layer ids off by one or blocks leaking across packed sequences
all break this equality.
"""

import numpy as np
import pytest
import torch
from sliding_targets import DOCUMENT_ARCHS, sliding_window_model

from dflash_train.data.packing import PackedBatch
from dflash_train.decode import static_lm
from dflash_train.models.chat import render_chat
from dflash_train.models.loading import byte_tokenizer, load_target
from dflash_train.models.target import Target
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig
from dflash_train.pipeline.features import packed_features

TOL = dict(rtol=1e-5, atol=1e-5)


def _pack(seqs: list[list[int]]) -> PackedBatch:
    ids = torch.tensor([t for s in seqs for t in s])
    seq = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    mask = torch.cat([(torch.arange(len(s)) >= 2).long() for s in seqs])
    return PackedBatch(ids, mask, seq, pos)


def _anchors(seqs: list[list[int]]) -> torch.Tensor:
    """Early, middle and last positions of each sequence: the last ones' blocks run past its end."""
    out, start = [], 0
    for s in seqs:
        out += [start + j for j in sorted({2, len(s) // 2, len(s) - 2, len(s) - 1})]
        start += len(s)
    return torch.tensor(out)


def _decode_style(target, drafter, tokens: list[int], j: int, static: bool = False) -> torch.Tensor:
    """The drafter's output at anchor j of one sequence, as the decode loop computes it: [B, H].
    static: the prefix's features from the decode engine's prefill (StaticLM), not HF's forward."""
    B, cfg = drafter.block_size, drafter.config
    with torch.no_grad():
        prefix = torch.tensor([tokens[:j]])  # the true prefix alone
        feats = _static_features(target, prefix, cfg.target_layer_ids) if static else target.features(
            prefix, cfg.target_layer_ids)
        block = torch.tensor([[tokens[j]] + [drafter.mask_token_id] * (B - 1)])
        pos = torch.arange(j + B)[None]
        return drafter(target.embed(block), feats, pos)[0]


def _static_features(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    lm = static_lm.for_model(target.model)
    n = ids.shape[1]
    out = lm.forward(ids, torch.arange(n)[None], lm.cache_for(1, n), static_lm.bucket(n), layers=tuple(layer_ids),
                     logits="none", prefill=True)
    return out.features


def _check(target, drafter, seqs, backend: str, feature_mode: str = "auto", static: bool = False) -> None:
    batch, anchors = _pack(seqs), _anchors(seqs)
    obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head, ObjectiveConfig(attention=backend),
                          embed_scale=target.embed_scale)  # Gemma's embedding scales its rows
    with torch.no_grad():
        feats = packed_features(target, batch, list(drafter.config.target_layer_ids), mode=feature_mode)
        blocks = obj.blocks(batch, anchors)
        hidden = obj.block_hidden(batch, blocks, obj.masks(batch, blocks), feats)[0]
    B, starts = drafter.block_size, torch.cumsum(torch.tensor([0] + [len(s) for s in seqs]), 0)
    for i, a in enumerate(anchors.tolist()):
        s = int(batch.seq_ids[a])
        want = _decode_style(target, drafter, seqs[s], a - int(starts[s]), static)
        torch.testing.assert_close(hidden[i * B:(i + 1) * B], want, **TOL, msg=f"anchor {a} ({backend})")


@pytest.fixture(scope="module")
def tiny():
    return load_target("random:tiny", device="cpu", dtype=torch.float32, seed=0)


def _seqs(n_seq=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (9 + 4 * i,), generator=g).tolist() for i in range(n_seq)]


@pytest.mark.parametrize("backend", ["dense", "flex"])
@pytest.mark.parametrize("sliding", [False, True])
def test_training_blocks_equal_decode_style_forward_on_the_true_prefix(tiny, make_drafter, perturb_norms, backend,
                                                                       sliding):
    kw = {"num_sliding_layers": 1, "sliding_window": 3} if sliding else {}
    _check(tiny, perturb_norms(make_drafter(num_layers=2, block_size=4, **kw), seed=5), _seqs(), backend)


@pytest.mark.parametrize("feature_mode", ["padded", "dense"])
def test_either_target_feature_path_gives_the_same_blocks(tiny, make_drafter, feature_mode):
    """The padded batch and the document-masked packed row both give the prefix's own features."""
    _check(tiny, make_drafter(num_layers=1, block_size=5), _seqs(seed=1), "dense", feature_mode)


def test_embedded_target_training_blocks_equal_decode_style_forward():
    from dflash_train.models.factory import drafter_config_for, new_drafter

    target = load_target("smollm2-135m")
    drafter = new_drafter(drafter_config_for(target, num_layers=1, block_size=4, dtype="float32"), seed=0).float()
    text = [render_chat(target, [{"role": "user", "content": t}]) for t in ("Hi there", "Write a loop in Python")]
    _check(target, drafter.eval(), [t[:14] for t in text], "dense")


@pytest.mark.parametrize("feature_mode", ["padded", "dense"])
@pytest.mark.parametrize("static", [False, True], ids=["hf", "static-lm"])
@pytest.mark.parametrize("arch", DOCUMENT_ARCHS)
def test_sliding_window_targets_training_blocks_equal_decode_style_forward(arch, static, feature_mode):
    """Gemma 3, gpt_oss, Mistral, Qwen2 and Qwen3 targets with sliding-window layers, sequences longer than the
    window: the packed row's features under its document masks (what training runs for them on unequal lengths)
    and the padded batch, against the prefix's features from HF's forward and from StaticLM."""
    from dflash_train.models.factory import drafter_config_for, new_drafter

    target = Target(model=sliding_window_model(arch), tokenizer=byte_tokenizer(), spec=f"{arch}-sliding-test")
    assert any(target.attention_windows) and target.takes_document_mask
    drafter = new_drafter(drafter_config_for(target, num_layers=1, block_size=4, dtype="float32"), seed=0).float()
    _check(target, drafter.eval(), _seqs(), "dense", feature_mode, static=static)


def test_memorised_sequences_replay_as_whole_blocks(tiny, in_memory_dataset, tmp_path):
    """End to end: train a drafter until it memorises two sequences, then replay them as the decode loop
    would (the true prefix's features, the block at the next position, accepted while drafts match the
    sequence). Any offset between training and serving (labels, context mask, positions, layer ids)
    leaves it guessing the wrong tokens; here every block is accepted whole."""
    from dflash_train.app.local import train_local
    from dflash_train.models.factory import drafter_config_for, new_drafter
    from dflash_train.settings.tree import TrainConfig

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 250, (40,), generator=g).tolist() for _ in range(2)]
    B = 4
    cfg = TrainConfig.of(run_dir=str(tmp_path), target="random:tiny", max_length=96, token_budget=192, num_anchors=64,
                      block_size=B, num_layers=1, max_steps=150, lr=5e-3, warmup_ratio=0.0, checkpoint_every=0,
                      log_every=50, seed=3)
    drafter = new_drafter(drafter_config_for(tiny, num_layers=1, block_size=B, dtype="float32"), cfg.run.seed).float()
    pairs = [(np.array(s), np.array([0] * 4 + [1] * (len(s) - 4))) for s in seqs]  # loss after a 4-token prompt
    train_local(cfg, tiny, drafter, in_memory_dataset(pairs), tmp_path, progress=False)
    drafter.eval()
    accepted = []
    for s in seqs:
        j = 4
        while j + B <= len(s):
            with torch.no_grad():
                draft = tiny.lm_head(_decode_style(tiny, drafter, s, j)[1:]).argmax(-1).tolist()
            a = next((i for i, (d, t) in enumerate(zip(draft, s[j + 1:j + B], strict=True)) if d != t), B - 1)
            accepted.append(a)
            j += a + 1
    assert sum(accepted) >= 0.9 * (B - 1) * len(accepted), accepted


def test_the_decodes_tau_replays_through_the_training_path(tiny, in_memory_dataset, tmp_path):
    """eval's tau_replay (training/replay.py): a drafter part-trained on the target's own greedy outputs accepts
    some drafts and misses others in the decode; the training path's blocks on the same outputs, stepped
    through as the decode steps, commit the same tokens at every step (float32: the two paths round alike),
    the last blocks cut short by the token limit included. A decode that drafted from other features,
    positions or masks than training would commit other counts."""
    from dflash_train.app.local import train_local
    from dflash_train.decode.speculative import speculative_generate, target_generate
    from dflash_train.eval.evaluate import EvalConfig, evaluate
    from dflash_train.eval.lookup import decode_commits
    from dflash_train.models.factory import drafter_config_for, new_drafter
    from dflash_train.settings.tree import TrainConfig
    from dflash_train.training.replay import accepted_runs, packed_runs, replay_commits

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (6,), generator=g).tolist() for _ in range(2)]
    outputs = [target_generate(tiny, p, 30).tokens for p in prompts]
    B = 4
    cfg = TrainConfig.of(run_dir=str(tmp_path), target="random:tiny", max_length=96, token_budget=192, num_anchors=64,
                      block_size=B, num_layers=1, max_steps=20, lr=5e-3, warmup_ratio=0.0, checkpoint_every=0,
                      log_every=50, seed=3)
    drafter = new_drafter(drafter_config_for(tiny, num_layers=1, block_size=B, dtype="float32"), cfg.run.seed).float()
    pairs = [(np.array(p + o), np.array([0] * len(p) + [1] * len(o))) for p, o in zip(prompts, outputs, strict=True)]
    train_local(cfg, tiny, drafter, in_memory_dataset(pairs), tmp_path, progress=False)
    drafter.eval()
    obj = DFlashObjective(drafter, tiny.embedding_weight, tiny.lm_head, ObjectiveConfig(attention="dense"))
    decoded = []
    for limit in (*range(5, 13), 30):  # < 30: the decode's last blocks are cut short, some mid-block
        for p in prompts:
            res = speculative_generate(tiny, drafter, p, limit)
            runs = accepted_runs(tiny, obj, p, res.tokens, limit)
            assert decode_commits(len(res.tokens), runs.__getitem__) == res.committed, (limit, p)
            # the target's labels of its own greedy output are that output: the same runs checked against them
            assert accepted_runs(tiny, obj, p, res.tokens, limit, target_labels=True) == runs
            decoded += res.accepted
        # prompts of three lengths in one pack (the eval's replay): the padded target forward and the blocks of
        # each sequence see only its own context
        mixed = [prompts[0], prompts[1][:3], prompts[0][2:] + prompts[1]]
        outs = [speculative_generate(tiny, drafter, p, limit).tokens for p in mixed]
        assert packed_runs(tiny, obj, list(zip(mixed, outs, strict=True)), limit) == \
            [accepted_runs(tiny, obj, p, o, limit) for p, o in zip(mixed, outs, strict=True)], limit
    assert 0 < sum(decoded) < (B - 1) * len(decoded), decoded  # neither nothing nor everything accepted
    report = evaluate(tiny, drafter, prompts, EvalConfig(limit=2, max_new_tokens=10, baseline=False), progress=False,
                      replay=replay_commits)
    assert report.tau_replay == pytest.approx(report.tau, abs=1e-9)
    assert report.per_prompt_tau_replay == pytest.approx(report.per_prompt_tau, abs=1e-9)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_the_device_loops_drafts_on_long_prompts_are_trainings(arch, monkeypatch):
    """The eval's device loop (greedy_loop: the prompt's drafter pass padded to a key bucket, then one step a
    block) drafts what training's blocks give at the same anchors, for prompts past one key bucket (128) and
    the target's window: every step's draft logits, compared one by one (CPU: the steps run eagerly)."""
    from dflash_train.decode import static_drafter
    from dflash_train.decode.speculative import speculative_generate
    from dflash_train.models.factory import drafter_config_for, new_drafter
    from dflash_train.training.replay import block_outputs

    target = Target(model=sliding_window_model(arch), tokenizer=byte_tokenizer(), spec=f"{arch}-sliding-test")
    cfg = drafter_config_for(target, num_layers=2, block_size=4, num_sliding_layers=1, sliding_window=3,
                             dtype="float32")
    drafter = new_drafter(cfg, seed=0).float().eval()
    engine = static_drafter.for_drafter(drafter, target.model.get_input_embeddings(), target.lm_head)
    steps, forward = [], engine.forward

    def recorded(features, block, meta, cache, kv_len):
        out = forward(features, block, meta, cache, kv_len)
        steps.append((meta.tolist(), block.shape[1], out.clone()))
        return out

    monkeypatch.setattr(engine, "forward", recorded)
    obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head, ObjectiveConfig(attention="dense"),
                          embed_scale=target.embed_scale)
    g = torch.Generator().manual_seed(2)
    try:
        for n in (140, 300):
            prompt = torch.randint(3, 250, (n,), generator=g).tolist()
            steps.clear()
            ids = prompt + speculative_generate(target, drafter, prompt, 24).tokens
            pos = torch.arange(len(ids))
            batch = PackedBatch(torch.tensor(ids), (pos >= n).long(), torch.zeros_like(pos), pos)
            with torch.no_grad():
                feats = packed_features(target, batch, list(cfg.target_layer_ids))
            full = [(meta[0] + meta[1], out) for meta, width, out in steps if width == 4 and meta[2] == 4]
            assert len(full) >= 4 and any(width == 1 for _, width, _ in steps)  # the prompt's pass ran
            for a, out in full:
                if a + 4 > len(ids):
                    continue
                with torch.no_grad():
                    want = target.lm_head(block_outputs(obj, batch, feats, torch.tensor([a]), 4)[0][0])
                torch.testing.assert_close(out[:3], want, **TOL, msg=f"{arch}: prompt {n}, anchor {a}")
    finally:
        static_drafter.release(drafter)


def test_prompt_lookup_copies_the_prompt_and_counts_as_the_decode_steps():
    from dflash_train.eval.lookup import lookup_tau

    # out[0] = 5 recalls the prompt's 5 -> drafts 6 7 8, all right (4 committed); then 9 recalls 7 8 9 -> drafts
    # 5 6 7, wrong at once (1 committed, the last token): 5 tokens in 2 steps
    assert lookup_tau([[5, 6, 7, 8, 9]], [[5, 6, 7, 8, 9, 1]], block_size=4) == 2.5
    assert lookup_tau([[1, 2]], [[3, 4, 5]], block_size=4) == 1.0  # nothing to copy: one token a step
    # a run of one token: each step copies only tokens already committed (the draft never reads ahead):
    # no draft, then 1, 1 and 3 of them right (the last step cut to the 2 tokens left): 7 tokens, 4 steps
    assert lookup_tau([[9]], [[5] * 8], block_size=4) == 1.75
