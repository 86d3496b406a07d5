"""The single-device trainer: exact resume, overfitting a tiny set, and the train command's guards."""

import json
import shutil

import numpy as np
import pytest
import torch

from dflash_train.app.local import train_local
from dflash_train.cli import main
from dflash_train.data.dataset import PreparedDataset, prepare_dataset
from dflash_train.data.regenerate import RegenConfig, regenerate
from dflash_train.data.sources import Conversation
from dflash_train.decode.speculative import target_generate
from dflash_train.errors import UsageError
from dflash_train.eval.evaluate import EvalConfig, evaluate
from dflash_train.models.chat import render_chat
from dflash_train.models.checkpoint import load_drafter
from dflash_train.models.factory import drafter_config_for, new_drafter
from dflash_train.settings.tree import TrainConfig
from dflash_train.training.checkpoint import latest_checkpoint, load_state

PROMPTS = ["def add(a, b):", "count to five", "hello there", "sort a list", "what is 2+2", "name a color"]


@pytest.fixture(scope="module")
def regenerated(tiny_target, tmp_path_factory):
    """Six conversations whose replies are the tiny target's own greedy outputs."""
    root = tmp_path_factory.mktemp("data")
    convs = [Conversation(f"c{i}", [{"role": "user", "content": p}]) for i, p in enumerate(PROMPTS)]
    regenerate(tiny_target, convs, root / "regen.jsonl", RegenConfig(max_new_tokens=40, batch_size=6), progress=False)
    rows = [json.loads(line) for line in (root / "regen.jsonl").read_text().splitlines()]
    convs = [Conversation(r["id"], r["messages"]) for r in rows]
    prepare_dataset(tiny_target.tokenizer, convs, root / "prepared", max_length=96)
    return convs, PreparedDataset.open(root / "prepared")


def _cfg(run_dir, **kw):
    base = dict(run_dir=str(run_dir), target="random:tiny", max_length=96, token_budget=192, num_anchors=16,
                block_size=4, log_every=1, checkpoint_every=3, keep_checkpoints=5, max_steps=6, lr=3e-3, seed=3)
    return TrainConfig.of(**(base | kw))


def _drafter(tiny_target, cfg):
    shape = drafter_config_for(tiny_target, num_layers=1, block_size=cfg.drafter.block_size, dtype="float32")
    d = new_drafter(shape, cfg.run.seed)
    return d.float()


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("feature_scale", ["none", "rms"])
def test_resume_reproduces_uninterrupted_losses(tiny_target, regenerated, tmp_path, feature_scale):
    _, data = regenerated
    cfg_a = _cfg(tmp_path / "a", feature_scale=feature_scale)
    train_local(cfg_a, tiny_target, _drafter(tiny_target, cfg_a), data, tmp_path / "a", progress=False)
    full = _losses(tmp_path / "a")
    assert len(full) == 6

    # Run b: the same run interrupted after step 3 (its step-3 checkpoint), then resumed.
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_0000003", tmp_path / "b" / "checkpoints" / "step_0000003")
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step_0000003\n")
    (tmp_path / "b" / "metrics.jsonl").write_text("".join(
        line + "\n" for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[:3]))
    ckpt = latest_checkpoint(tmp_path / "b")
    cfg_b = _cfg(tmp_path / "b", feature_scale=feature_scale)
    drafter = load_drafter(ckpt / "drafter", dtype=torch.float32)
    state = load_state(ckpt)
    assert state["step"] == 3
    assert ("feature_scale" in state) == (feature_scale == "rms")
    result = train_local(cfg_b, tiny_target, drafter, data, tmp_path / "b", state, progress=False)
    assert result.steps == 6
    resumed = _losses(tmp_path / "b")
    assert resumed[:3] == full[:3]
    torch.testing.assert_close(torch.tensor(resumed[3:]), torch.tensor(full[3:]), rtol=1e-6, atol=1e-6)


def test_feature_scale_trains_fc_in_unit_columns_and_exports_it_folded(tiny_target, regenerated, tmp_path,
                                                                          capsys):
    """--feature-scale rms: the first pack sets the scale, and the run says its range; the trained drafter in
    memory (scaled features, fc in their units) and its export (reference format: the scale folded into fc)
    compute the same context."""
    _, data = regenerated
    cfg = _cfg(tmp_path, feature_scale="rms", checkpoint_every=0)
    drafter = _drafter(tiny_target, cfg)
    train_local(cfg, tiny_target, drafter, data, tmp_path, progress=False)
    assert drafter.feature_scale is not None and drafter.feature_scale.shape == drafter.fc.weight.shape[1:]
    low, high = torch.log2(drafter.feature_scale).aminmax()
    assert f"times 2^{int(low)} to 2^{int(high)} a column" in capsys.readouterr().err
    exported = load_drafter(latest_checkpoint(tmp_path) / "drafter", dtype=torch.float32)
    assert exported.feature_scale is None
    assert torch.equal(exported.fc.weight, drafter.fc.weight * drafter.feature_scale)  # powers of two: exact
    features = torch.randn(1, 7, drafter.fc.weight.shape[1]) / drafter.feature_scale  # the target's column scales
    torch.testing.assert_close(exported.fuse(features), drafter.fuse(features), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(exported.fc.weight, drafter.fc.weight)


def test_feature_scale_with_distillation_and_a_resume_that_disagrees(tiny_target, regenerated, tmp_path):
    """The scale covers the drafter's features only (distillation sends the target's final layer after them); a
    resume must train as the run did: a flag that disagrees with the checkpoint is refused, naming it."""
    _, data = regenerated
    cfg = _cfg(tmp_path, feature_scale="rms", kd_weight=0.5, max_steps=2, checkpoint_every=0)
    drafter = _drafter(tiny_target, cfg)
    train_local(cfg, tiny_target, drafter, data, tmp_path, progress=False)
    assert drafter.feature_scale.shape == drafter.fc.weight.shape[1:]
    ckpt = latest_checkpoint(tmp_path)
    for flag in ("none", "rms"):
        state = load_state(ckpt)
        if flag == "rms":
            del state["feature_scale"]  # a run trained unscaled, resumed with rms
        with pytest.raises(UsageError, match=f"--feature-scale {flag}: the run resumed from step 2"):
            train_local(_cfg(tmp_path, feature_scale=flag, kd_weight=0.5, max_steps=4), tiny_target,
                        load_drafter(ckpt / "drafter", dtype=torch.float32), data, tmp_path, state, progress=False)


def test_feature_rms_scale_sets_unit_columns_without_first_tokens():
    from dflash_train.training.drafter_loop import feature_rms_scale

    torch.manual_seed(0)
    widths = torch.tensor([1e-2, 1.0, 30.0, 1e4])
    hidden = torch.randn(4000, 4) * widths
    positions = torch.arange(4000) % 100
    hidden[positions == 0] = 1e6  # each sequence's first token (Gemma's <bos>: ~100x the rest) is left out
    scale = feature_rms_scale(hidden.bfloat16(), positions)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two: folding it in is exact
    rms = (hidden[positions > 0] * scale).square().mean(0).sqrt()
    assert bool(((rms > 2**-0.5 * 0.98) & (rms < 2**0.5 * 1.02)).all()), rms  # unit RMS, to the nearest power of 2
    quiet = torch.ones(50, 5)
    quiet[:, 3], quiet[:, 4] = 1e-9, 0.0  # near-dead columns are scaled at most ~1000x
    assert feature_rms_scale(quiet, torch.arange(50) + 1).tolist() == [1.0, 1, 1, 1024, 1024]


@pytest.mark.parametrize("clip", [0.5, 1e6, 0.0])
def test_the_clip_folded_into_a_fused_adamw_steps_as_clipping_first(clip):
    """A fused AdamW takes the clip as its grad_scale (training/update.py): the same weights as clipping the
    gradients and then stepping, whether the clip binds (0.5), does not (1e6) or is off; the pre-clip norm
    returned either way."""
    from types import SimpleNamespace

    from dflash_train.training.update import Update, make_optimizer

    class Objective(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))

        def forward(self, x):
            return SimpleNamespace(loss=self.model(x).square().sum() * 50)  # a norm far above 0.5

    torch.manual_seed(0)
    fused, plain = Objective(), Objective()
    plain.load_state_dict(fused.state_dict())
    start = [p.detach().clone() for p in fused.parameters()]
    updates = []
    for obj, on in ((fused, True), (plain, None)):
        opt = make_optimizer(obj.model, 1e-2, 0.1)
        for group in opt.param_groups:  # CPU: make_optimizer picks the unfused one
            group["fused"], group["foreach"], group["eps"] = on, None, 1e-3  # eps: the step feels the clip
        updates.append(Update(obj, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), grad_clip=clip))
    for step in range(3):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        norms = []
        for update in updates:
            update.micro(x)
            norms.append(update.step())
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
        assert norms[0] > 100  # the clip at 0.5 binds
    for a, b in zip(fused.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(not torch.equal(a, b) for a, b in zip(fused.parameters(), start, strict=True))


def test_column_spread_is_each_layers_largest_column_over_its_median():
    from dflash_train.training.drafter_loop import column_spread

    rms = torch.tensor([1.0, 2.0, 3.0, 900.0,  # layer 0: median 2 (the lower middle of four), largest 900
                        5.0, 5.0, 5.0, 5.0])
    assert column_spread(rms, 2).tolist() == [450.0, 1.0]


@pytest.mark.parametrize("flag,threshold,hinted", [("none", 1.0, True), ("none", 1e9, False), ("rms", 1.0, False)])
def test_a_fresh_run_on_uneven_features_suggests_the_scale(tiny_target, regenerated, tmp_path, capsys, monkeypatch,
                                                           flag, threshold, hinted):
    """A fresh drafter's run without --feature-scale rms says so when a feature column runs SPREAD_HINT times its
    layer's median (the tiny target's features do not: the threshold is lowered to show the line), once; a run
    with the scale says nothing of it."""
    from dflash_train.training import drafter_loop

    monkeypatch.setattr(drafter_loop, "SPREAD_HINT", threshold)
    _, data = regenerated
    cfg = _cfg(tmp_path, feature_scale=flag, max_steps=2, checkpoint_every=0)
    train_local(cfg, tiny_target, _drafter(tiny_target, cfg), data, tmp_path, progress=False)
    err = capsys.readouterr().err
    assert err.count("consider --feature-scale rms") == (1 if hinted else 0), err


def test_overfit_tiny_set_loss_falls_and_tau_rises(tiny_target, in_memory_dataset, tmp_path):
    """Train on the target's own greedy continuations of six prompts, then decode those prompts."""
    prompts = [render_chat(tiny_target, [{"role": "user", "content": p}]) for p in PROMPTS]
    pairs = []
    for prompt in prompts:
        reply = target_generate(tiny_target, prompt, 40).tokens
        pairs.append((np.array(prompt + reply), np.array([0] * len(prompt) + [1] * len(reply))))
    cfg = _cfg(tmp_path, max_steps=150, checkpoint_every=0, lr=5e-3, warmup_ratio=0.0, num_anchors=64, log_every=10)
    drafter = _drafter(tiny_target, cfg)
    before = evaluate(tiny_target, drafter.eval(), prompts, EvalConfig(max_new_tokens=24), progress=False)
    train_local(cfg, tiny_target, drafter, in_memory_dataset(pairs), tmp_path, progress=False)
    losses = _losses(tmp_path)
    assert losses[-1] < losses[0] - 0.5  # the frozen random LM head has tiny logits: CE falls slowly
    after = evaluate(tiny_target, drafter.eval(), prompts, EvalConfig(max_new_tokens=24), progress=False)
    assert after.lossless == before.lossless == "exact"
    assert after.tau > before.tau + 0.5, (before.tau, after.tau)


def test_mfu_per_record_from_the_packs_flops_and_absent_on_cpu(tiny_target, in_memory_dataset, tmp_path, monkeypatch):
    import dflash_train.app.local as local
    from dflash_train.pipeline.stream import PackStream
    from dflash_train.profiling.flops import PackFlops

    rng = np.random.default_rng(0)
    data = in_memory_dataset([(rng.integers(0, 200, 60), np.r_[np.zeros(10, int), np.ones(50, int)]) for _ in range(4)])
    cfg = _cfg(tmp_path / "cpu", max_steps=3, checkpoint_every=0)
    result = train_local(cfg, tiny_target, _drafter(tiny_target, cfg), data, tmp_path / "cpu", progress=False)
    records = [json.loads(line) for line in (tmp_path / "cpu" / "metrics.jsonl").read_text().splitlines()]
    assert "mfu" not in result.last_record and not any("mfu" in r for r in records)  # CPU: no peak, no MFU

    # The CUDA path on CPU: a counter as train builds one on CUDA; each record's mfu is its packs' FLOPs.
    drafter = _drafter(tiny_target, cfg)
    counter = PackFlops.build(tiny_target.config, drafter.config, list(drafter.config.target_layer_ids),
                              tiny_target.vocab_size, devices=2)
    monkeypatch.setattr(local, "flop_counter", lambda *args, **kw: counter)
    cfg = _cfg(tmp_path / "gpu", max_steps=3, checkpoint_every=0)
    result = train_local(cfg, tiny_target, drafter, data, tmp_path / "gpu", progress=False)
    records = [json.loads(line) for line in (tmp_path / "gpu" / "metrics.jsonl").read_text().splitlines()]
    packs = list(PackStream(data, cfg.data.token_budget, cfg.objective.num_anchors, cfg.run.seed, 1).packs(3))
    for rec, pack in zip(records, packs, strict=True):  # log_every=1: one pack per record
        assert rec["mfu"] * rec["elapsed_s"] * 2 * 989e12 == pytest.approx(counter.of(pack), rel=1e-9)
    assert result.last_record["mfu"] == records[-1]["mfu"] > 0


def test_run_dir_with_checkpoints_is_refused(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_0000001\n")
    assert main(["train", "--target", "random:tiny", "--run-dir", str(tmp_path), "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_a_mask_token_inside_the_data_is_refused(prepared, tmp_path, capsys):
    """The token that marks the slots to guess must never be a token of the data."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    ids = np.load(data / "input_ids.npy")
    ids[7] = 260  # random:tiny's mask token (its first spare embedding row)
    np.save(data / "input_ids.npy", ids)
    argv = ["train", "--target", "random:tiny", "--run-dir", str(tmp_path / "run"), "--data", str(data),
            "--max-length", "96", "--token-budget", "192", "--max-steps", "1", "--eval-limit", "0", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dflash-train: error:")]
    assert len(errors) == 1 and "mask token 260 occurs 1 times in the training data" in errors[0]


@pytest.mark.parametrize("argv,needle", [
    (["--num-anchors", "0"], "--num-anchors"),
    (["--max-length", "4", "--block-size", "8"], "--max-length"),
    (["--block-size", "1"], "--block-size"),
    (["--lr", "-1"], "--lr"),
    (["--on-bad", "ignore"], "--on-bad"),
    (["--labels", "teacher"], "--labels"),
    (["--attention", "flex", "--device", "cpu"], "--attention flex: its kernels run on CUDA, not cpu"),
    (["--attention", "intervals", "--device", "cpu"], "--attention intervals: its kernels run on CUDA, not cpu"),
    (["--compile-masks", "--device", "cpu"], "--compile-masks: compiled masks are FlexAttention's and the interval"),
])
def test_bad_train_options(tmp_path, capsys, argv, needle):
    assert main(["train", "--target", "random:tiny", "--run-dir", str(tmp_path / "r"), *argv]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("dflash-train: error:")]
    assert len(errors) == 1 and needle in errors[0]  # one line (progress lines may come before it)


def test_toml_config_and_overrides(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[objective]\nnum_anchors = 0\n')
    assert main(["train", "--config", str(cfg), "--run-dir", str(tmp_path / "r")]) == 2
    assert "--num-anchors" in capsys.readouterr().err
    cfg.write_text('[objective]\nnum_ankors = 5\n')
    assert main(["train", "--config", str(cfg)]) == 2
    assert "[objective] has no option 'num_ankors'" in capsys.readouterr().err
    cfg.write_text('[objective]\nnum_anchors = "many"\n')
    assert main(["train", "--config", str(cfg)]) == 2
    assert "num_anchors" in capsys.readouterr().err


def test_tau_before_training_is_measured_for_a_drafter_that_starts_trained(tmp_path):
    from dflash_train.app.train import evaluates_before

    fresh, trained = TrainConfig.of(), TrainConfig.of(init_drafter="some/drafter")
    assert not evaluates_before(fresh, None) and evaluates_before(trained, None)  # auto
    assert evaluates_before(TrainConfig.of(eval_before="yes"), None)
    assert not evaluates_before(TrainConfig.of(init_drafter="d", eval_before="no"), None)
    assert not evaluates_before(TrainConfig.of(eval_before="yes"), tmp_path)  # resumed: part-trained


def test_train_command_end_to_end_on_tiny(tmp_path, capsys):
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({"id": f"x{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    run = tmp_path / "run"
    argv = ["train", "--target", "random:tiny", "--device", "cpu", "--run-dir", str(run), "--data", str(data),
            "--num-conversations", "0",
            "--regen-max-new-tokens", "24", "--max-length", "96", "--token-budget", "192", "--block-size", "4",
            "--max-steps", "4", "--eval-limit", "1", "--eval-max-new-tokens", "8", "--eval-dataset", str(data),
            "--quiet"]
    assert main(argv + ["--eval-before", "yes"]) == 0
    out = capsys.readouterr().out
    assert "note: on a CPU the speedup above says little" in out
    phases = json.loads((run / "phases.json").read_text())  # where the job's time went, phase by phase
    assert list(phases) == ["load target", "select", "regenerate", "prepare", "eval before", "train", "eval after",
                            "other", "total"]
    assert all(s >= 0 for s in phases.values()) and phases["train"] > 0
    assert abs(sum(phases.values()) - 2 * phases["total"]) < 0.5 and f"run {phases['total']:.0f} s: load target" in out
    assert (run / "drafter" / "model.safetensors").is_file() and (run / "config.toml").is_file()
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 1
    assert any((run / "tb").iterdir())
    assert json.loads((run / "eval_after.json").read_text())["lossless"] == "exact"
    assert main(argv + ["--max-steps", "6", "--resume"]) == 0  # continues from step 4
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 6
