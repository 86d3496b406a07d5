"""The command line: init-drafter + eval end to end, and one-line errors with exit code 2."""

import json
import os
import subprocess
import sys

import pytest

from dflash_train.cli import main


def _prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "def add(a, b):"}, {"messages": [{"role": "user", "content": "hello there"}]},
            {"conversations": [{"from": "human", "value": "count to five"}, {"from": "gpt", "value": "1 2 3 4 5"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def tiny_drafter_dir(tmp_path):
    out = tmp_path / "drafter"
    assert main(["init-drafter", "--target", "random:tiny", "--num-layers", "2", "--block-size", "4",
                 "--out", str(out), "--save-dtype", "float32"]) == 0
    return out


def test_init_drafter_then_eval_writes_report(tiny_drafter_dir, tmp_path, capsys):
    cfg = json.loads((tiny_drafter_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    # a spare embedding row has no text, so no mask_token string; no sliding layers: non-causal stated
    assert cfg["dflash_config"] == {"mask_token_id": 260, "target_layer_ids": [1, 2, 3], "block_size": 4,
                                    "causal": False}
    assert cfg["is_causal"] is False
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 6 and len(cfg["layer_types"]) == 2
    out = tmp_path / "report.json"
    code = main(["eval", "--target", "random:tiny", "--drafter", str(tiny_drafter_dir), "--dataset",
                 str(_prompts_file(tmp_path)), "--limit", "3", "--max-new-tokens", "16", "--json", str(out), "--quiet"])
    assert code == 0
    rep = json.loads(out.read_text())
    for key in ("tau", "lossless", "speedup", "per_position_acceptance", "histogram"):
        assert key in rep
    assert rep["lossless"] == "exact" and rep["num_prompts"] == 3 and len(rep["histogram"]) == 4
    assert "tau (mean accepted length)" in capsys.readouterr().out
    # tau only: the same drafts, no target-only decode, so no speedup and no lossless verdict
    code = main(["eval", "--target", "random:tiny", "--drafter", str(tiny_drafter_dir), "--dataset",
                 str(_prompts_file(tmp_path)), "--limit", "3", "--max-new-tokens", "16", "--json", str(out), "--quiet",
                 "--no-baseline"])
    tau_only = json.loads(out.read_text())
    assert code == 0 and tau_only["tau"] == rep["tau"] and tau_only["speedup"] is None and tau_only["lossless"] is None


def test_eval_reports_tau_per_prompt_and_per_category(tiny_drafter_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "word " * (3 + 5 * i), "category": "ab"[i % 2]}) + "\n"
                               for i in range(4)))
    out = tmp_path / "report.json"
    assert main(["eval", "--target", "random:tiny", "--drafter", str(tiny_drafter_dir), "--dataset", str(prompts),
                 "--max-new-tokens", "16", "--json", str(out), "--quiet", "--no-baseline"]) == 0
    rep = json.loads(out.read_text())
    tau, steps = rep["per_prompt_tau"], rep["per_prompt_steps"]
    assert len(tau) == len(steps) == 4 and sum(steps) == rep["steps"]
    weighted = lambda idx: sum(tau[i] * steps[i] for i in idx) / sum(steps[i] for i in idx)  # noqa: E731
    assert weighted(range(4)) == pytest.approx(rep["tau"])
    assert list(rep["tau_by_category"]) == ["a", "b"]
    assert rep["tau_by_category"]["a"] == pytest.approx(weighted([0, 2]))
    assert rep["tau_by_category"]["b"] == pytest.approx(weighted([1, 3]))
    assert "tau by category:            a " in capsys.readouterr().out


def test_a_real_divergence_is_a_mismatch_and_fails_require_lossless(tiny_drafter_dir, tmp_path, monkeypatch, capsys):
    """A DFlash loop that commits a wrong token: listed with its gap, `eval --require-lossless` exits 1."""
    import torch

    from dflash_train.decode.speculative import speculative_generate
    from dflash_train.eval import evaluate as ev

    def broken(target, drafter, prompt, *args, **kwargs):  # commits the target's least likely token third
        res = speculative_generate(target, drafter, prompt, *args, **kwargs)
        with torch.no_grad():
            res.tokens[2] = int(target.model(torch.tensor([prompt + res.tokens[:2]])).logits[0, -1].argmin())
        return res

    monkeypatch.setattr(ev, "speculative_generate", broken)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "word " * (30 + i)}) + "\n" for i in range(2)))
    argv = ["eval", "--target", "random:tiny", "--device", "cpu", "--drafter", str(tiny_drafter_dir), "--dataset",
            str(prompts), "--limit", "2", "--max-new-tokens", "6", "--quiet", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0  # reported, not fatal, unless asked
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["lossless"] == "mismatch" and rep["mismatched_prompts"] == [0, 1]
    assert [d["position"] for d in rep["divergences"]] == [2, 2] and all(d["gap"] > 1e-3 for d in rep["divergences"])
    assert "MISMATCH" in capsys.readouterr().out
    assert main(argv + ["--require-lossless"]) == 1


def _error(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("dflash-train: error:") and "\n" not in err and "Traceback" not in err
    return err


def test_bad_inputs_give_one_line_and_exit_2(tiny_drafter_dir, tmp_path, capsys):
    prompts = str(_prompts_file(tmp_path))
    ev = ["eval", "--target", "random:tiny", "--dataset", prompts, "--limit", "1", "--quiet"]
    assert "--target" in _error(["init-drafter", "--target", "bogus", "--out", str(tmp_path / "x")], capsys)
    assert "--block-size" in _error(["init-drafter", "--target", "random:tiny", "--block-size", "1",
                                     "--out", str(tmp_path / "x")], capsys)
    assert "--target-layer-ids" in _error(["init-drafter", "--target", "random:tiny", "--target-layer-ids", "1,9",
                                           "--out", str(tmp_path / "x")], capsys)
    assert "--target-layer-ids: 5 is the target's last layer" in _error(
        ["init-drafter", "--target", "random:tiny", "--target-layer-ids", "1,5", "--out", str(tmp_path / "x")], capsys)
    assert "--mask-token-id" in _error(["init-drafter", "--target", "random:tiny", "--mask-token-id", "65",
                                        "--out", str(tmp_path / "x")], capsys)
    assert "--num-key-value-heads must divide the target's 4 attention heads, got 3" in _error(
        ["init-drafter", "--target", "random:tiny", "--num-key-value-heads", "3", "--out", str(tmp_path / "x")], capsys)
    assert "config.json" in _error(ev + ["--drafter", str(tmp_path / "missing")], capsys)
    assert "--block-size" in _error(ev + ["--drafter", str(tiny_drafter_dir), "--block-size", "1"], capsys)
    assert "--max-new-tokens" in _error(ev + ["--drafter", str(tiny_drafter_dir), "--max-new-tokens", "0"], capsys)
    assert "--dataset" in _error(ev[:4] + ["--dataset", "nope", "--drafter", str(tiny_drafter_dir)], capsys)
    assert "invalid int" in _error(["eval", "--drafter", "x", "--limit", "many"], capsys)
    assert "--regen-samples 2 needs" in _error(["train", "--run-dir", str(tmp_path / "r"), "--regen-samples", "2"],
                                               capsys)


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids", "causal"):
            cfg["dflash_config"][key] = value
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes,needle", [
    ({"architectures": ["Qwen3ForCausalLM"]}, "not a DFlash drafter"),
    ({"block_size": 1}, "block_size"),
    ({"target_layer_ids": [1, 40]}, "target_layer_ids"),
    ({"mask_token_id": 65}, "mask_token_id"),
    ({"num_target_layers": 28}, "num_target_layers"),
    ({"target_layer_ids": [1, 5]}, "[5] is the target's last layer"),  # random:tiny has 6 layers
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
    ({"is_causal": True}, "is_causal = True is not supported"),
    ({"causal": True}, "dflash_config.causal = True is not supported"),
    ({"input_embedding_scale": 2.0}, "input_embedding_scale = 2.0 is not supported"),
    ({"output_multiplier": 0.5}, "output_multiplier = 0.5 is not supported"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0 is not supported"),
])
def test_bad_drafter_configs(tiny_drafter_dir, tmp_path, capsys, changes, needle):
    bad = _edit_config(tiny_drafter_dir, tmp_path / "bad", **changes)
    err = _error(["eval", "--target", "random:tiny", "--drafter", str(bad), "--dataset",
                  str(_prompts_file(tmp_path)), "--quiet"], capsys)
    assert needle in err


def test_export_states_what_each_engine_reads(tmp_path):
    """The keys vLLM, SGLang and the reference read (docs/models.md), with the values they expect."""
    from dflash_train.models.checkpoint import load_config

    out = tmp_path / "d"
    assert main(["init-drafter", "--target", "random:tiny", "--num-layers", "3", "--block-size", "8",
                 "--sliding-layers", "1", "--sliding-window", "5", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 8
    assert cfg["num_target_layers"] == 6 and max(cfg["dflash_config"]["target_layer_ids"]) <= 6 - 2
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "full_attention"]
    # sliding layers: transformers keeps sliding_window only with use_sliding_window; causality per
    # layer is each engine's default (sliding causal, full not), so no global causal flag is written
    assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == 5
    assert "is_causal" not in cfg and "causal" not in cfg["dflash_config"]
    assert cfg["hidden_act"] == "silu" and cfg["num_hidden_layers"] == 3
    assert load_config(out).layer_types == cfg["layer_types"]


@pytest.mark.parametrize("text, needle", [("[1, 2]", "is not a JSON object"),
                                         (None, "a field has the wrong type")])
def test_malformed_drafter_configs_are_one_line_naming_the_flag(tiny_drafter_dir, tmp_path, capsys, text, needle):
    bad = _edit_config(tiny_drafter_dir, tmp_path / "bad", rms_norm_eps="small")
    if text is not None:
        (bad / "config.json").write_text(text)
    err = _error(["eval", "--target", "random:tiny", "--drafter", str(bad), "--dataset",
                  str(_prompts_file(tmp_path)), "--quiet"], capsys)
    assert needle in err and err.startswith("dflash-train: error: --drafter")
    err = _error(["train", "--target", "random:tiny", "--run-dir", str(tmp_path / "r"), "--init-drafter", str(bad),
                  "--quiet"], capsys)
    assert needle in err and "--init-drafter" in err


def test_a_target_without_chat_template_runs_in_the_plain_format_and_says_so(tiny_drafter_dir, tmp_path, capsys):
    from dflash_train.models import chat
    from dflash_train.models.loading import load_target

    target = load_target("random:tiny")
    target.model.save_pretrained(tmp_path / "base")
    target.tokenizer.chat_template = None
    target.tokenizer.save_pretrained(tmp_path / "base")
    chat._reported.clear()
    assert main(["eval", "--target", str(tmp_path / "base"), "--drafter", str(tiny_drafter_dir), "--dataset",
                 str(_prompts_file(tmp_path)), "--limit", "1", "--max-new-tokens", "4", "--quiet"]) == 0
    assert "chat format: plain (User: … Assistant: …, turns end at EOS)" in capsys.readouterr().err


def test_neutral_values_of_unsupported_settings_load(tiny_drafter_dir, tmp_path):
    """A checkpoint that states the settings we compute (non-causal, no scaling, no softcap) loads."""
    from dflash_train.models.checkpoint import load_config

    ok = _edit_config(tiny_drafter_dir, tmp_path / "ok", is_causal=False, causal=False, input_embedding_scale=1.0,
                      output_multiplier=1, final_logit_softcapping=None)
    assert load_config(ok).target_layer_ids == [1, 2, 3]


def test_hidden_size_mismatch(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["init-drafter", "--target", "random:tiny", "--num-layers", "1", "--block-size", "4",
                 "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    # A drafter for a different target: rewrite it as a valid drafter of hidden size 32.
    from dflash_train.models.checkpoint import save_drafter
    from dflash_train.models.config import DFlashConfig
    from dflash_train.models.factory import new_drafter

    c = DFlashConfig.from_reference_dict(cfg)
    c.hidden_size, c.intermediate_size = 32, 64
    c.validate()
    save_drafter(new_drafter(c), out)
    err = _error(["eval", "--target", "random:tiny", "--drafter", str(out), "--dataset",
                  str(_prompts_file(tmp_path)), "--quiet"], capsys)
    assert "hidden_size" in err


@pytest.mark.slow
def test_console_script_usage_error_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dflash_train.cli", "eval", "--drafter", str(tmp_path),
                           "--target", "random:nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "random:nope" in proc.stderr


def test_the_console_script_runs_the_command_line_and_imports_it_only_then():
    """Spawned tokenizer workers import the script that started the job as their main module (dflash_train/entry.py):
    the module the installed `dflash-train` imports at its top must not pull in torch or the project."""
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["dflash-train"].partition(":")
    heavy = ("torch", "transformers", "dflash_train.cli")
    probe = f"import sys, {module}; print([m for m in {heavy!r} if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
    for command in ([sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"],
                    [sys.executable, "-m", "dflash_train"]):  # a source tree's way in (the recipe's scripts)
        run = subprocess.run([*command, "eval", "--drafter", "/nonexistent", "--target", "random:nope"],
                             capture_output=True, text=True)
        assert run.returncode == 2 and "random:nope" in run.stderr  # the command line's own one-line error
    probe = f"import sys, dflash_train.__main__; print([m for m in {heavy!r} if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_a_job_started_by_the_command_counts_its_start_up_and_one_inside_a_process_does_not(monkeypatch):
    """phases.json's `start-up`: the process's age when the job's clock starts, where the command started the
    process (entry.py), so the phases' total is the process's wall time; a job called inside a longer-lived process
    (here: the tests') has no such phase."""
    import time

    from dflash_train.app import phases

    monkeypatch.setattr(phases, "_process_start", None)
    assert "start-up" not in phases.Phases.of_job().report()
    age = phases.process_age()
    if age is None:
        pytest.skip("no /proc: the process's start cannot be read here")
    probe = "import time; time.sleep(1.5); from dflash_train.app.phases import process_age; print(process_age())"
    child = float(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    assert 1.5 <= child < 30  # the sleep, plus the interpreter's start
    phases.command_started()
    job = phases.Phases.of_job()
    time.sleep(0.05)
    start_up, total = job.seconds["start-up"], job.total()  # not the report's, rounded to the millisecond
    assert list(job.report())[0] == "start-up" and start_up >= age - 0.02 and total >= start_up + 0.05
    assert abs(total - phases.process_age()) < 0.05  # the job's clock is the process's


def test_filesystem_failures_are_one_line_errors(tmp_path, capsys):
    """A directory where the output file goes, and a full disk (/dev/full): one line naming the path, exit 2."""
    data = tmp_path / "convs.jsonl"
    data.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    base = ["regenerate", "--target", "random:tiny", "--data", str(data), "--split", "all", "--max-new-tokens", "2",
            "--quiet", "--out"]
    (tmp_path / "adir").mkdir()
    assert main([*base, str(tmp_path / "adir")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash-train: error: {tmp_path / 'adir'}: Is a directory")
    if os.path.exists("/dev/full"):
        assert main([*base, "/dev/full"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "No space left on device" in err[0]


def test_a_users_file_is_used_whole_and_sharegpt_counts_its_held_out_slice(tmp_path, capsys):
    """Only the embedded ShareGPT keeps a held-out slice (for eval); a file of your own is not split unless asked."""
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                                    {"role": "assistant", "content": f"a{i}"}]}) + "\n"
                            for i in range(200)))
    base = ["prepare", "--target", "random:tiny", "--data", str(data), "--max-length", "64"]
    assert main([*base, "--out", str(tmp_path / "whole")]) == 0
    assert json.loads((tmp_path / "whole" / "meta.json").read_text())["sequences"] == 200
    assert main([*base, "--split", "train", "--out", str(tmp_path / "train")]) == 0
    out = capsys.readouterr().out
    kept = json.loads((tmp_path / "train" / "meta.json").read_text())["sequences"]
    assert 180 < kept < 200 and f"left out {200 - kept}: {200 - kept} held out for evaluation" in out
    assert f"{kept} conversations used of 200 read" in out  # the held-out slice is not subtracted twice


def test_prepare_and_regenerate_commands(tmp_path, capsys):
    data = tmp_path / "convs.jsonl"
    good = {"id": "g1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]}
    data.write_text(json.dumps(good) + "\n" + '{"messages": [\n' + json.dumps({"prompt": "no reply"}) + "\n")
    base = ["--target", "random:tiny", "--data", str(data), "--split", "all"]
    err = _error(["prepare", *base, "--max-length", "64", "--out", str(tmp_path / "p"), "--on-bad", "error"], capsys)
    assert "convs.jsonl:2: malformed JSON" in err and "--on-bad skip" in err
    assert main(["prepare", *base, "--max-length", "64", "--out", str(tmp_path / "p")]) == 0  # skip: the default
    out = capsys.readouterr().out
    assert "skipped 2 bad records" in out and "1 sequences" in out
    assert (tmp_path / "p" / "meta.json").is_file()
    assert main(["regenerate", *base, "--max-new-tokens", "4", "--out", str(tmp_path / "r.jsonl"),
                 "--quiet"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["g1", "convs.jsonl:3"] and rows[0]["messages"][-1]["role"] == "assistant"


def test_the_cli_leaves_the_tokenizer_on_every_core(monkeypatch):
    """The job tokenizes in batches (selection, regeneration's prompts and replies): TOKENIZERS_PARALLELISM=false
    had put each batch on one core (36 s of the H200 recipe's regeneration). Set, so forks print no warning;
    a user's own setting wins."""
    from dflash_train import cli

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    cli._quiet_libraries()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    cli._quiet_libraries()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_init_drafter_writes_the_kv_heads_it_was_given(tmp_path):
    """--num-key-value-heads reaches config.json (what serving engines read) and the saved K/V projections."""
    from dflash_train.models.checkpoint import load_drafter

    out = tmp_path / "wide"
    assert main(["init-drafter", "--target", "random:tiny", "--num-layers", "1", "--block-size", "4",
                 "--num-key-value-heads", "4", "--out", str(out), "--save-dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 4
    drafter = load_drafter(str(out))
    assert drafter.layers[0].self_attn.k_proj.weight.shape[0] == 4 * drafter.config.head_dim


def test_a_progress_line_during_a_bar_gets_a_line_of_its_own(capsys):
    """say() while a tqdm bar is drawn clears the bar, writes its line and redraws the bar: printed plainly, the
    line would continue the bar's (a train log's first lines did)."""
    from tqdm import tqdm

    from dflash_train.errors import say

    with tqdm(total=3, desc="train", file=sys.stderr) as bar:
        bar.update(1)
        say("a progress line")
    say("no bar")
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert "[dflash-train] a progress line" in lines and "[dflash-train] no bar" in lines
