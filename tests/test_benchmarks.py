"""Every script under benchmarks/ runs its CPU plumbing here: tiny shapes, a few steps, seconds each.

A flag or config change that breaks a benchmark script (a flag renamed, a config value that a
script's fixed flags now contradict) fails here instead of on a lent GPU. Each test runs the
script as its header says, in a subprocess with this tree's sources, and checks that it exits 0
and writes what it promises (JSON keys, logs, summaries). The figures themselves mean nothing
on a CPU. The subprocess tests are `slow`; the in-process checks of the scripts' helpers are not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import interpreted

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
TINY = "random:tiny"
# train flags that shrink configs/smollm2-h200.toml to the tiny target on a CPU (raw replies: no regeneration)
TINY_TRAIN = ("--device cpu --target random:tiny --num-conversations 40 --no-regenerate --regen-samples 1 "
              "--no-compile-drafter --no-compile-masks --no-compile-target --num-layers 1 --intermediate-size 128 "
              "--max-steps 2 --max-length 128 --token-budget 512 --eval-limit 2 --eval-max-new-tokens 8 "
              "--val-conversations 0")
QUICK_EVAL = {"EVAL_LIMIT": "2", "MTBENCH_LIMIT": "2", "EVAL_TOKENS": "8"}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # the scripts' python3
    env["OMP_NUM_THREADS"] = "1"  # a busy CI host: one thread per process
    env.pop("TRITON_INTERPRET", None)
    env.update(extra)
    return env


def _run(args: list[str], tmp_path: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """Run a script from the repository root; fail with its output unless it exits 0."""
    proc = subprocess.run(args, cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert proc.returncode == 0, f"{' '.join(args)}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _py(script: str, *args: str) -> list[str]:
    return [sys.executable, str(BENCH / script), *args]


def _json(path: Path, *keys: str) -> dict:
    data = json.loads(path.read_text())
    missing = [k for k in keys if k not in data]
    assert not missing, f"{path}: no {missing} in {sorted(data)}"
    return data


def _load(script: str):
    """A benchmark script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))  # sibling imports (decode_speed, recipe_summary)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_every_benchmark_script_has_a_test_here():
    """A new script under benchmarks/ needs its CPU plumbing run in this file (or a named reason not to)."""
    text = Path(__file__).read_text()
    scripts = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))
    assert scripts, BENCH
    untested = [s for s in scripts if f'"{s}"' not in text]
    assert not untested, f"no plumbing test in tests/test_benchmarks.py for {untested}"


# --- Python scripts: one process each -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_moe_combine(tmp_path):
    proc = _run(_py("moe_combine.py", "--device", "cpu", "--tokens", "16", "--width", "64", "--experts", "8",
                    "--top-k", "2", "--blocks", "32,64"), tmp_path, TRITON_INTERPRET="1")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("T=16")]
    assert [ln.split()[1] for ln in lines] == ["hf", "index_add", "triton", "triton"], proc.stdout
    assert all(float(ln.rsplit(" ", 1)[1]) < 0.05 for ln in lines), proc.stdout  # bf16 rounding of the products


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_sample_speed(tmp_path):
    proc = _run(_py("sample_speed.py", "--device", "cpu", "--rows", "4", "--vocab", "40", "--blocks", "16,32"),
                tmp_path, TRITON_INTERPRET="1")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("rows=4 vocab=40")]
    assert [ln.split()[2] for ln in lines] == ["multinomial", "kernel", "kernel"], proc.stdout


@pytest.mark.slow
def test_data_stages(tmp_path):
    out = tmp_path / "stages.json"
    _run(_py("data_stages.py", "--target", TINY, "--conversations", "300", "--regen-prompts", "10",
             "--prepare", "10", "--json", str(out)), tmp_path)
    data = _json(out, "select_batched_s", "select_one_at_a_time_s", "regen_render_batched_s",
                 "prepare_encode_batched_s", "prepare_dataset_s", "prepare")
    assert data["select_conversations"].endswith("of 300")


@pytest.mark.slow
@interpreted
def test_span_attention_under_the_triton_interpreter(tmp_path):
    out = tmp_path / "span.json"
    _run(_py("span_attention.py", "--device", "cpu", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
             "--contexts", "40", "--layers", "1", "--reps", "1", "--json", str(out)), tmp_path, TRITON_INTERPRET="1")
    data = _json(out, "us_per_call", "device", "date", "command")
    assert sorted(data["us_per_call"]) == ["draft8@40", "token@40", "verify8@40"]
    assert all(set(row) == {"batched", "span_b32_w4_s2"} for row in data["us_per_call"].values()), data


@pytest.mark.slow
@interpreted
def test_train_attention_under_the_triton_interpreter(tmp_path):
    out = tmp_path / "train_attention.json"
    _run(_py("train_attention.py", "--device", "cpu", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
             "--block-size", "4", "--num-anchors", "4", "--seq-len", "40", "--token-budget", "120", "--reps", "1",
             "--tiles", "16x16", "32x16x4x2/16x32/16x16x4x3", "--profile", "--json", str(out)), tmp_path,
         TRITON_INTERPRET="1")
    data = _json(out, "full", "sliding", "device", "date", "command")
    for kind in ("full", "sliding"):
        rows = data[kind]["backends"]
        assert [r["name"] for r in rows] == ["dense", "intervals 16x16x4x2/16x16x4x2/16x16x4x2",
                                             "intervals 32x16x4x2/16x32x4x2/16x16x4x3"]
        assert all(max(r["max_err"].values()) < 1e-4 and r["kernels"] for r in rows), rows


@pytest.mark.slow
@interpreted
def test_decode_attention_under_the_triton_interpreter(tmp_path):
    out = tmp_path / "attention.json"
    _run(_py("decode_attention.py", "--device", "cpu", "--target", TINY, "--rows", "4", "--min-len", "8",
             "--max-len", "24", "--regen-rows", "4", "--new-tokens", "2", "--reps", "1", "--no-compiled",
             "--json", str(out)), tmp_path, TRITON_INTERPRET="1")
    data = _json(out, "attention", "regen_batched", "regen_kernel", "regen_kernel_fused")
    kernels = [k for k in data["attention"] if k.startswith("kernel_")]
    assert len(kernels) == 6 and all(data["attention"][k]["max_abs_diff"] < 1e-3 for k in kernels), data["attention"]


@pytest.mark.slow
def test_decode_parts(tmp_path):
    out = tmp_path / "parts.json"
    _run(_py("decode_parts.py", "--device", "cpu", "--target", TINY, "--draft-layers", "2", "--block-size", "4",
             "--sliding-layers", "1", "--intermediate-size", "96", "--context", "32", "--reps", "2",
             "--without", "tails", "--without", "target-tails", "--without", "merge", "--without", "project", "--json",
             str(out)), tmp_path)
    assert _json(out, "target", "device", "date")["without"] == ["tails", "target-tails", "merge", "project"]


@pytest.mark.slow
def test_ab_runs_a_benchmark_in_both_trees(tmp_path):
    """"ab.sh": the command in the base tree, then in this one, each importing its own sources, {} per run."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(REPO / "src", base / "src")
    shutil.copytree(BENCH, base / "benchmarks")
    proc = _run(["bash", str(BENCH / "ab.sh"), str(base), "1", sys.executable, "benchmarks/decode_parts.py",
                 "--device", "cpu", "--target", TINY, "--draft-layers", "1", "--block-size", "4", "--context", "32",
                 "--reps", "1", "--json", str(tmp_path / "parts-{}.json")], tmp_path, timeout=300)
    for tag in ("base1", "new1"):
        assert f"{tag} | eager dflash_step" in proc.stdout and (tmp_path / f"parts-{tag}.json").is_file()
    bad = subprocess.run(["bash", str(BENCH / "ab.sh"), str(tmp_path / "nowhere"), "1", "true"],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "has no src/" in bad.stderr


@pytest.mark.slow
def test_decode_speed(tmp_path):
    out = tmp_path / "decode.json"
    _run(_py("decode_speed.py", "--device", "cpu", "--target", TINY, "--regen-rows", "4", "--regen-hf-rows", "2",
             "--new-tokens", "4", "--prompt-min", "8", "--prompt-max", "16", "--batch1-prompts", "2",
             "--block-size", "4", "--draft-layers", "1", "--json", str(out)), tmp_path)
    _json(out, "regen_static", "batch1_static", "dflash_static", "dflash_static_host_loop", "dflash_static_gpu_only",
          "regen_hf", "batch1_hf", "dflash_hf", "break_even_tau_static", "break_even_tau_hf")


@pytest.mark.slow
def test_eval_overhead(tmp_path):
    out = tmp_path / "overhead.json"
    _run(_py("eval_overhead.py", "--device", "cpu", "--target", TINY, "--draft-layers", "1", "--block-size", "4",
             "--prompts", "2", "--prompt-min", "8", "--prompt-max", "16", "--new-tokens", "4", "--json", str(out)),
         tmp_path)
    _json(out, "eval_ms_per_step", "back_to_back_ms_per_step", "per_prompt_ms", "first_step_ms", "steps", "tau")


@pytest.mark.slow
def test_mix_order_guard_runs_its_path_on_the_cpu(tmp_path):
    """The Inductor fusion it measures is CUDA's: on a CPU (aot_eager) only the script's path runs."""
    out = tmp_path / "mix.json"
    _run(_py("mix_order_guard.py", "--device", "cpu", "--backend", "aot_eager", "--sizes", "64", "32",
             "--reps", "1", "--json", str(out)), tmp_path)
    data = _json(out, "graphs_after_each_size", "first_calls_s", "fwd_bwd_ms", "sizes")
    assert set(data["graphs_after_each_size"]) == {"default", "non_strict", "mix_off"}
    assert all(len(g) == 2 for v in data["graphs_after_each_size"].values() for g in v.values())


@pytest.mark.slow
def test_pack_padding(tmp_path):
    out = tmp_path / "padding.json"
    _run(_py("pack_padding.py", "--target", TINY, "--limit", "100", "--token-budget", "2048", "--json", str(out)),
         tmp_path)
    data = _json(out, "sequences", "real_tokens", "padded_batch_tokens", "packed_row_tokens", "command")
    assert data["sequences"] == 200  # two reply chains a conversation
    assert data["real_tokens"] <= data["packed_row_tokens"] < data["padded_batch_tokens"]


def test_pack_padding_counts_one_pack():
    """Lengths 10, 20 and 300 in one pack: 330 real tokens, a padded batch of 3 x 300, a flex row of 3 tiles."""
    import numpy as np

    got = _load("pack_padding.py").count(np.array([10, 20, 300]), 330, seed=0)
    assert [got[k] for k in ("packs", "real_tokens", "padded_batch_tokens", "packed_row_tokens")] == [1, 330, 900, 384]


def test_gil_convoy(tmp_path):
    out = tmp_path / "convoy.json"
    _run(_py("gil_convoy.py", "--calls", "50", "--json", str(out)), tmp_path)
    rows = _json(out, "us_per_call", "date", "command")["us_per_call"]
    assert {"alone", "beside a process"} <= set(rows) and len(rows) == 5
    assert all(us > 0 for us in rows.values())


@pytest.mark.slow
def test_regen_widths(tmp_path):
    out = tmp_path / "widths.json"
    _run(_py("regen_widths.py", "--target", TINY, "--limit", "150", "--batch-size", "16", "--pool-batches", "1", "4",
             "--json", str(out)), tmp_path)
    data = _json(out, "conversations", "selection_order", "sorted_per_turn_pool_1", "sorted_per_turn_pool_4")
    assert data["conversations"] == 150
    assert 0 < data["selection_order"]["useful_share"] <= data["sorted_per_turn_pool_4"]["useful_share"] <= 1


@pytest.mark.slow
def test_relabel_speed(tmp_path, prepared):
    out = tmp_path / "relabel.json"
    _run(_py("relabel_speed.py", "--data", prepared, "--target", TINY, "--device", "cpu", "--json", str(out)),
         tmp_path)
    figures = _json(out, "tokens", "labels_equal_share")
    assert figures["labels_equal_share"] == 1.0  # float32 on a CPU: both ways give the same labels
    ways = [k for k in figures if k.startswith(("padded-", "packed-"))]
    assert len(ways) == 2 and all(figures[k]["tokens_per_s"] > 0 for k in ways), figures


@pytest.mark.slow
def test_reply_loops(tmp_path):
    proc = _run(_py("reply_loops.py", "--device", "cpu", "--target", TINY, "--limit", "2", "--new-tokens", "8",
                    "--split", "4", "--ngram", "2"), tmp_path)
    assert "sharegpt T=0: 2 replies" in proc.stdout and "with the prompt" in proc.stdout
    assert ">= 64 tokens back" in proc.stdout


@pytest.mark.slow
def test_tau_by_prompt(tmp_path):
    from dflash_train.eval.prompts import load_prompts
    from dflash_train.models.chat import render_chat
    from dflash_train.models.loading import load_target

    record, out = tmp_path / "eval.json", tmp_path / "by_prompt.json"
    record.write_text(json.dumps({"per_prompt_tau": [1.5, 2.0, 3.0], "per_prompt_tau_replay": [1.5, 2.5, 3.0],
                                  "block_size": 4}))
    _run(_py("tau_by_prompt.py", "--device", "cpu", "--target", TINY, "--record", str(record), "--dataset", "sharegpt",
             "--new-tokens", "8", "--json", str(out)), tmp_path)
    figures = _json(out, "tau_by_prompt_third", "tau_by_copy_dist", "corr_tau_prompt", "prompts", "reply_tokens",
                    "dtype")
    rows = figures["prompts"]
    assert [r["tau"] for r in rows] == [1.5, 2.0, 3.0] and len(figures["tau_by_prompt_third"]) == 3
    assert [r["replay"] for r in rows] == [1.5, 2.5, 3.0] and all("replay" in t for t in figures["tau_by_prompt_third"])
    target = load_target(TINY)
    assert [r["prompt"] for r in rows] == [len(render_chat(target, m)) for m in load_prompts("sharegpt", 3)]
    assert all(0 <= r["copy_prompt"] + r["copy_reply"] <= 1 and 0 < r["reply"] <= 8 for r in rows), rows
    assert figures["reply_tokens"] == sum(r["reply"] for r in rows)


def test_tau_by_prompt_bins_the_copying_replies_by_their_median_copy_distance():
    summary = _load("tau_by_prompt.py").summary

    def row(tau, dist, copied=0.9):
        return {"tau": tau, "prompt": dist, "copy_prompt": copied, "copy_reply": 0.0, "copy_dist": dist, "lookup": 5.0}

    rows = [row(5.0, 10), row(4.0, 20), row(2.0, 100), row(1.0, 400), row(9.0, 40, copied=0.2)]  # last: few copies
    bins = summary(rows)["tau_by_copy_dist"]
    assert [(b["copy_dist"], b["prompts"], b["tau"]) for b in bins] == [([0, 32], 2, 4.5), ([64, 128], 1, 2.0),
                                                                         ([128, None], 1, 1.0)]


def test_tau_by_prompt_splits_prompts_into_thirds_by_length_whatever_their_count():
    thirds = _load("tau_by_prompt.py").thirds
    rows = [{"prompt": n} for n in (50, 10, 40, 20, 30)]
    assert [[r["prompt"] for r in t] for t in thirds(rows)] == [[10], [20, 30], [40, 50]]
    assert [len(t) for t in thirds(rows[:2])] == [0, 1, 1] and [len(t) for t in thirds(rows[:1])] == [0, 0, 1]


def test_copy_distances_measure_back_to_the_last_occurrence_followed_by_the_same_token():
    copy_distances = _load("tau_by_prompt.py").copy_distances
    prompt, reply = [1, 2, 9], [1, 2, 9, 1, 2, 7]
    # reply positions from the second on (1-grams): 2 after 1, 9 after 2, 1 after 9 (the prompt's 9 was followed
    # by the reply's first 1), 2 after 1, each 3 back; 7 after 2 never
    assert copy_distances(prompt + reply, len(prompt), n=1) == [3, 3, 3, 3, None]
    # a later occurrence followed by another token does not hide an earlier one followed by the same
    assert copy_distances([5, 6, 5, 8, 5, 6], 4, n=1) == [4]


def test_record_json_writes_the_figures_and_nothing_without_a_path(tmp_path):
    write_json = _load("record_json.py").write_json
    out = tmp_path / "figures.json"
    write_json(str(out), {"tau": 1.5, "rows": [1, 2]})
    assert json.loads(out.read_text()) == {"tau": 1.5, "rows": [1, 2]}
    write_json(None, {"tau": 2.0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json"]  # no temporaries left


@pytest.mark.slow
def test_init_loss(tmp_path):
    out = tmp_path / "init.json"
    _run(_py("init_loss.py", "--device", "cpu", "--target", TINY, "--num-layers", "2", "--block-size", "4",
             "--intermediate-size", "128", "--limit", "2", "--new-tokens", "16", "--json", str(out)), tmp_path)
    figures = _json(out, "from-target", "fresh", "from-target+final-norm")
    assert figures["anchors"] > 0 and all(figures[s]["loss"] > 0 for s in ("from-target", "fresh"))
    assert figures["from-target"] == figures["from-target+final-norm"]  # a Llama-style target: the norm is copied


@pytest.mark.slow
def test_feature_columns(tmp_path):
    out = tmp_path / "columns.json"
    _run(_py("feature_columns.py", "--device", "cpu", "--target", TINY, "--limit", "2", "--new-tokens", "16",
             "--json", str(out)), tmp_path)
    layers = _json(out, "layers")["layers"]
    assert len(layers) >= 2 and all(0 < v["median_column_rms"] <= v["rms"] for v in layers.values())
    for share in ("share_raw", "share_rms"):
        assert sum(v[share] for v in layers.values()) == pytest.approx(1.0)
    assert all(abs(v["share_rms"] - 1 / len(layers)) < 0.2 for v in layers.values())  # unit columns: even shares


@pytest.mark.slow
def test_accept_by_copy(tmp_path):
    regenerated = tmp_path / "regenerated.jsonl"
    records = [[{"role": "user", "content": "say abc abc abc"}, {"role": "assistant", "content": "abc abc abc abc"}],
               [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there, hello there"}, {"role": "user", "content": "again"}]]
    regenerated.write_text("".join(json.dumps({"id": str(i), "messages": m}) + "\n" for i, m in enumerate(records)))
    out = tmp_path / "by_copy.json"
    _run(_py("accept_by_copy.py", "--device", "cpu", "--target", TINY, "--block-size", "4", "--limit", "2",
             "--new-tokens", "8", "--regenerated", str(regenerated), "--json", str(out)), tmp_path)
    figures = _json(out, "humaneval greedy", "regenerated")
    for text in ("humaneval greedy", "regenerated"):
        bins = figures[text]
        assert list(bins) == ["none", "< 32", "32-63", "64-127", ">= 128"]
        assert sum(b["anchors"] for b in bins.values()) > 0
        assert all(b["accepted"] is None or 0 <= b["accepted"] <= 3 for b in bins.values()), bins


def test_accept_by_copy_bins_each_anchor_by_the_copy_after_it():
    by_copy = _load("accept_by_copy.py").by_copy
    prompt, reply = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 9]
    # the reply repeats the prompt: its tokens 4 and 5 (after anchors 3 and 4) follow a 4-gram of the prompt, 7
    # back; tokens 1..3 have no 4 tokens of the repeat before them yet; anchors past 4 (8 - B) have drafts
    # past the reply's end
    table = by_copy([(prompt, reply)], [[0, 1, 0, 3, 2, 1, 0, 0]], 4)
    assert (table["none"]["anchors"], table["< 32"]["anchors"], table["32-63"]["anchors"]) == (3, 2, 0)
    assert (table["< 32"]["accepted"], table["< 32"]["first_draft"]) == (2.5, 1.0)
    assert table["none"]["accepted"] == 0.333 and table[">= 128"]["accepted"] is None


def test_copy_predictable_counts_the_prompts_ngrams_when_asked():
    copy_predictable = _load("reply_loops.py").copy_predictable
    prompt, reply = [1, 2, 3, 4], [1, 2, 3, 5, 1, 2, 3]
    assert copy_predictable(reply, 2) == [False, False, False, False, True]  # the reply's own loop only
    # with the prompt's 2-grams seen first, reply[2] = 3 follows (1, 2) as in the prompt (and reply[6] again)
    assert copy_predictable(prompt + reply, 2, len(prompt)) == [False, False, True, False, False, False, True]
    # how far back: reply[2] copies the prompt's 3, reply[6] the reply's own 3 (the latest occurrence, not the
    # prompt's 8 back), each 4 back
    copy_back = _load("reply_loops.py").copy_back
    assert copy_back(prompt + reply, 2, len(prompt)) == [None, None, 4, None, None, None, 4]


def test_train_serve_gap_finds_no_gap_in_float32(tmp_path):
    """In float32 on the CPU training's and the decode's features, labels and drafts agree to rounding."""
    out = tmp_path / "gap.json"
    _run(_py("train_serve_gap.py", "--device", "cpu", "--target", TINY, "--dtype", "float32", "--limit", "2",
             "--new-tokens", "12", "--block-size", "4", "--json", str(out)), tmp_path)
    figures = _json(out, "labels_equal_greedy", "drafts_argmax_agree", "drafts_logits_rel_diff")
    layers = [v for k, v in figures.items() if k.startswith("layer ")]
    assert layers and all(v["decode_vs_training"] < 1e-4 for v in layers), layers
    assert figures["labels_equal_greedy"] == 1.0 and figures["drafts_argmax_agree"] == 1.0, figures
    assert figures["drafts_logits_rel_diff"] < 1e-4, figures


@pytest.mark.slow
def test_target_load(tmp_path):
    from tiny_gguf import write_tiny_gguf

    gguf, out = write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "load.json"
    _run(_py("target_load.py", "--target", str(gguf), "--runs", "1", "--json", str(out)), tmp_path)
    data = _json(out, "cold", "warm", "device_init_s", "transformers", "command")
    assert len(data["cold"]["seconds"]) == len(data["warm"]["seconds"]) == 1


@pytest.mark.slow
def test_target_features(tmp_path):
    out = tmp_path / "features.json"
    _run(_py("target_features.py", "--device", "cpu", "--target", TINY, "--steps", "2", "--warmup", "1",
             "--token-budget", "256", "--max-length", "64", "--median-length", "32", "--json", str(out)), tmp_path)
    assert "padded" in out.read_text() and "auto" in out.read_text()


def test_target_profile(tmp_path):
    """Each experts kernel of a MoE target timed and its operators sorted into kinds; the grouped kernel's
    GEMMs are counted as grouped GEMMs."""
    out = tmp_path / "profile.json"
    _run(_py("target_profile.py", "--device", "cpu", "--target", "random:tiny-qwen3-moe", "--experts",
             "eager,grouped_mm", "--seq-len", "32", "--sequences", "2", "--steps", "1", "--warmup", "1",
             "--json", str(out)), tmp_path)
    runs = _json(out, "runs", "tflop_per_forward", "sequences")["runs"]
    assert set(runs) == {"eager", "grouped_mm"}
    assert all(r["host_ms"] > 0 and r["wall_ms_from_idle"] > 0 for r in runs.values())
    assert "grouped GEMM" in runs["grouped_mm"]["kinds"] and "grouped GEMM" not in runs["eager"]["kinds"]
    assert all(r["tokens_per_s"] > 0 and abs(sum(k["share"] for k in r["kinds"].values()) - 1) < 1e-6
               for r in runs.values())


def test_target_profile_sorts_h100_kernels_by_what_they_do():
    """Kernel names of the 2026-12-05 H100 profiles: CUTLASS's grouped GEMM, and Inductor's fused chains by their
    prefix, whatever operators their names list."""
    kind_of = _load("target_profile.py").kind_of
    assert kind_of("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13Gemm"
                   "UniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEE") == "grouped GEMM"
    assert kind_of("triton_per_fused__to_copy__unsafe_view_add_div_ge_index_masked_fill_mul_sum_unsqueeze_view_11") \
        == kind_of("triton_poi_fused__grouped_mm_ge_masked_fill_mul_silu_split_transpose_unsqueeze_8") \
        == "Inductor fused chains"
    assert kind_of("triton_tem_fused_flex_attention_backward_transpose_view_5") == "attention"
    assert kind_of("nvjet_sm90_tst_128x192_64x5_2x1_v_bz_coopB_TNN") == "GEMM"


def test_drafter_step(tmp_path):
    out = tmp_path / "step.json"
    _run(_py("drafter_step.py", "--device", "cpu", "--target", TINY, "--num-layers", "2", "--block-size", "4",
             "--num-anchors", "8", "--seq-len", "64", "--token-budget", "256", "--intermediate-size", "128",
             "--num-key-value-heads", "4", "--steps", "1", "--warmup", "1", "--json", str(out)), tmp_path)
    res = _json(out, "ms_per_step", "kinds", "top", "tflop_per_step")
    assert res["target_tokens"] == 256 and res["block_tokens"] == 4 * 8 * 4  # four sequences, 8 anchors each
    assert res["attention"] == "dense"  # the tiled kernels need CUDA
    assert res["kinds"]["GEMM"]["ms"] > 0


def test_eval_clock(tmp_path):
    """The eval as the train job runs it, its timed decodes and the events on its clock (none on a CPU)."""
    out = tmp_path / "clock.json"
    _run(_py("eval_clock.py", "--device", "cpu", "--target", TINY, "--layers", "1", "--prompts", "3",
             "--new-tokens", "16", "--json", str(out)), tmp_path)
    res = _json(out, "eval", "events")
    assert res["eval"]["steps"] >= 3 * 15 // 8 and res["eval"]["dflash_ms_per_step"] > 0
    assert list(res["eval"]["phases_s"]) == ["warm-up", "decode", "checks"] and res["events"] == []


@pytest.mark.slow
def test_memory_plan_check(tmp_path):
    out = tmp_path / "memory.json"
    _run(_py("memory_plan_check.py", "--device", "cpu", "--presets", "tiny,tiny-qwen3-moe", "--tokens", "256",
             "--features", "2", "--experts", "grouped_mm", "--json", str(out)), tmp_path,
         MALLOC_MMAP_THRESHOLD_="65536")
    rows = _json(out, "device", "rows")["rows"]
    assert [(r["preset"], r["experts"]) for r in rows] == [("tiny", None), ("tiny-qwen3-moe", "grouped_mm")]
    assert all(r["weights_gb"] > 0 and r["plan_weights_gb"] > 0 and r["plan_activations_gb"] > 0 for r in rows)


@pytest.mark.slow
def test_planted_sync_on_the_cpu_slows_its_stage(tmp_path):
    """Without CUDA the sync plant is a 20 ms sleep: the stage it names shows it, and the TRAIN_SECONDS
    stop ends `train` with 0."""
    run = tmp_path / "run"
    proc = _run(_py("planted.py", "train", "--config", "configs/smollm2-h200.toml", "--run-dir", str(run),
                    *TINY_TRAIN.split(), "--max-steps", "50", "--eval-limit", "0", "--checkpoint-every", "0",
                    "--profile-interval", "1", "--quiet"),
                tmp_path, PLANT="sync:drafter.masks", TRAIN_SECONDS="2")
    assert "the planted sync is a 20 ms sleep" in proc.stderr and "sync planted in drafter.masks" in proc.stderr
    assert "stopped at step" in proc.stderr
    last = [json.loads(x) for x in (run / "profile.jsonl").read_text().splitlines()][-1]
    masks = last["loops"]["drafter"]["cumulative"]["stages"]["drafter.masks"]
    assert masks["total_s"] / masks["count"] >= 0.02


def test_planted_stages_resolve(monkeypatch):
    """Each stage planted.py knows still names a function the pipeline calls (a rename fails here)."""
    planted = _load("planted.py")
    for stage, (where, attr) in planted.STAGES.items():
        module, _, cls = where.partition(":")
        owner = getattr(__import__(module, fromlist=["_"]), cls) if cls else __import__(module, fromlist=["_"])
        monkeypatch.setattr(owner, attr, getattr(owner, attr))  # restored after the test
        planted.plant(f"sleep:{stage}:0")
        assert getattr(owner, attr).__wrapped__ is not None


# --- shell scripts ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_profile_h200_plumbing_with_the_shipped_config(tmp_path):
    """The shipped config as it is (its regen_samples included) under the script's fixed flags: every
    step exits 0, the runs write profile records, the reports and the summary are made."""
    out = tmp_path / "prof"
    _run(["bash", str(BENCH / "profile_h200.sh"), str(out)], tmp_path, timeout=240,
         DEVICE="cpu", TARGET=TINY, CONVS="40", TRAIN_SECONDS="2", WARM_SECONDS="1", INTERVAL="1", RUNS="a c",
         TRAIN_FLAGS="--token-budget 256 --max-length 64 --num-anchors 4 --num-layers 1 --intermediate-size 128 "
                     "--no-compile-drafter --no-compile-masks --no-compile-target",
         BENCH_FLAGS="--target random:tiny --device cpu --num-layers 1 --block-size 4 --num-anchors 8 --seq-len 64 "
                     "--steps 2")
    steps = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines())
    assert steps == {"env": "0", "warm": "0", "a": "0", "c": "0", "reports": "0", "bench": "0"}, steps
    for run in ("a", "c"):
        assert (out / run / "profile.jsonl").stat().st_size > 0
        assert "verdicts" in (out / f"report-{run}.log").read_text()
    summary = (out / "summary.txt").read_text()
    assert "allocator-churn verdict in c: NO" in summary  # no allocator telemetry on a CPU
    assert "compare-ac: rank 1" in summary and "bench overlap+cuda" in summary
    _json(out / "bench-8b.json", "variants")


@pytest.mark.slow
def test_quality_pair_runs_two_quality_runs(tmp_path):
    """quality_pair.sh runs benchmarks/quality_h200.sh twice (B on A's copied data): both
    scripts' plumbing, with each run's quality.json."""
    a, b = tmp_path / "qa", tmp_path / "qb"
    _run(["bash", str(BENCH / "quality_pair.sh"), str(a), str(b), TINY_TRAIN, TINY_TRAIN + " --lr 2e-3"],
         tmp_path, timeout=240, **QUICK_EVAL)
    assert (tmp_path / "qa.pair.done").is_file()
    log = (tmp_path / "qa.pair.log").read_text()
    assert "A done: rc 0" in log and "B done: rc 0" in log, log
    for run in (a, b):
        q = _json(run / "quality.json", "tau_humaneval", "tau_mtbench", "tau_sharegpt", "speedup", "train_tokens",
                  "steps", "wall_s", "phases_s", "device", "command")
        assert q["steps"] == 2 and q["device"] == "cpu"
        assert (run / "train.log").is_file()  # moved in once the job ended
    assert "quality_h200.sh" in json.loads((b / "quality.json").read_text())["command"]


@pytest.mark.slow
def test_quality_run_of_another_recipe_config(tmp_path):
    """quality_h200.sh with CONFIG: the Gemma recipe's file, shrunk to the tiny target; its record names it."""
    run = tmp_path / "q"
    _run(["bash", str(BENCH / "quality_h200.sh"), str(run), *TINY_TRAIN.split()], tmp_path, timeout=240,
         CONFIG="configs/gemma3-h200.toml", **QUICK_EVAL)
    q = _json(run / "quality.json", "tau_humaneval", "steps", "command")
    assert q["steps"] == 2 and q["command"].startswith("CONFIG=configs/gemma3-h200.toml bash")
    assert (run / "config.toml").read_text().count('data_topic = "any"') == 1  # the config's, under the flags


def test_quality_smollm2_h200_is_the_general_script_with_its_config(tmp_path):
    proc = subprocess.run(["bash", str(BENCH / "quality_smollm2_h200.sh")], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode != 0 and "usage: quality_h200.sh RUN_DIR" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_recipe_step_times_each_lever_and_summarises(tmp_path):
    """recipe_step.sh's levers as bench runs of the drafter-only step; pack32k doubles --token-budget."""
    out = tmp_path / "step"
    _run(["bash", str(BENCH / "recipe_step.sh"), str(out)], tmp_path, timeout=240, DEVICE="cpu", TARGET=TINY,
         LEVERS="base pack32k", STEPS="2",
         SHAPE="--num-layers 2 --block-size 4 --num-anchors 8 --seq-len 64 --token-budget 256 --sliding-layers 1")
    base, big = (_json(out / f"{lever}.json", "variants", "config") for lever in ("base", "pack32k"))
    assert (base["config"]["token_budget"], big["config"]["token_budget"]) == (256, 512)
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[1].split()[0] == "base" and lines[1].split()[-1] == "1.000" and lines[2].split()[0] == "pack32k"


@pytest.mark.slow
def test_recipe_sweep_and_its_summary(tmp_path):
    """recipe_sweep.sh with two variants, the second on the first's prepared data (the same data flags),
    then the script's "recipe_summary.py": the table, summary.json and the curve."""
    out = tmp_path / "sweep"
    proc = _run(["bash", str(BENCH / "recipe_sweep.sh"), str(out), f"base|{TINY_TRAIN}", f"lr|{TINY_TRAIN} --lr 2e-3"],
                tmp_path, timeout=240, TARGET=TINY, EVAL_FLAGS="--no-baseline", **QUICK_EVAL)
    rows = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in rows] == ["base", "lr"], rows
    assert all(r.get("tau_humaneval") for r in rows), rows
    assert (out / "curve.png").is_file() and "variant" in proc.stdout
    for name in ("base", "lr"):
        assert (out / name / "train.status").read_text().split()[0] == "0"
        assert all((out / name / f"eval-{d}.json").is_file() for d in ("humaneval", "mtbench", "sharegpt"))
    assert not list((out / "lr").glob("data-*")), "the second variant prepared its own data"


# --- the scripts' helpers, in process ---------------------------------------------------------------

def _window(kind: str, also: tuple[str, ...] = (), churning: bool = True, index: int = 0) -> dict:
    """A steady drafter-bound window of a CUDA run whose allocator churns, as recorded."""
    verdict = {"kind": kind, "message": kind}
    if also:
        verdict["also"] = list(also)
    return {"type": "profile", "process": "main/cuda:0", "elapsed_s": 10.0 * (index + 1), "window_s": 10.0,
            "loops": {"target": {"stages": {"hs_queue_full_wait": {"share": 0.4}}, "counters": {"tokens": 1}},
                      "drafter": {"stages": {"backward": {"share": 0.5}}, "counters": {"tokens": 1},
                                  "rates": {"tokens_per_s": 1000.0}}},
            "allocator": {"window": index, "device_allocs": 8 if churning else 0, "device_frees": 8 if churning else 0,
                          "alloc_retries": 0},
            "verdict": verdict}


@pytest.mark.parametrize("recorded", ["before qualifiers", "with qualifiers"])
def test_profile_h200_summary_finds_churn_beside_a_role_verdict(tmp_path, recorded):
    """Run c's churn held in every steady window while the drafter limited them all: the summary says YES,
    from the records' qualifiers, and from this tree's rules for records written before them."""
    script = _load("profile_h200.py")
    also = ("allocator-churn",) if recorded == "with qualifiers" else ()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "profile.jsonl").write_text(
        "".join(json.dumps(_window("drafter-bound", also, index=i)) + "\n" for i in range(8)))
    text = "\n".join(script._run_lines(tmp_path, "c", "churn:drafter.lm_head_loss"))
    assert "verdicts of 6 steady windows: drafter-bound 6" in text
    assert "allocator-churn verdict in c: YES" in text, text
    assert "allocator-churn 6/6" in text  # the rule held in every steady window
    if also:
        assert "qualifiers (in brackets beside the verdict): allocator-churn 6" in text
    else:
        assert "by this tree's rules: drafter-bound 6; qualifiers allocator-churn 6" in text


def test_profile_h200_summary_says_no_without_churn(tmp_path):
    script = _load("profile_h200.py")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "profile.jsonl").write_text(
        "".join(json.dumps(_window("drafter-bound", churning=False, index=i)) + "\n" for i in range(5)))
    assert "allocator-churn verdict in c: NO" in "\n".join(script._run_lines(tmp_path, "c", "churn:x"))


def test_trace_gaps_charges_each_idle_gap_to_the_kernel_after_it(tmp_path):
    """benchmarks/trace_gaps.py on a made-up trace: the union of overlapping kernels is busy time, each gap goes to
    the kernel that ended it, a trace without kernels is refused."""
    import gzip

    events = [{"cat": "kernel", "name": "a", "ts": 0, "dur": 10}, {"cat": "kernel", "name": "b", "ts": 5, "dur": 10},
              {"cat": "kernel", "name": "c", "ts": 45, "dur": 5}, {"cat": "kernel", "name": "c", "ts": 2050, "dur": 10},
              {"cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 2060}]
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = tmp_path / "gaps.json"
    _run([sys.executable, str(BENCH / "trace_gaps.py"), str(trace), "--json", str(out)], tmp_path, timeout=60)
    got = json.loads(out.read_text())
    assert got["kernels"] == 4 and got["span_ms"] == 2.06 and got["busy_ms"] == 0.03 and got["steps_ms"] == [2.06]
    assert got["gaps"][">=20us"] == {"count": 2, "ms": 2.03} and got["gaps"][">=1000us"] == {"count": 1, "ms": 2.0}
    assert got["before"] == [{"kernel": "c", "gaps": 2, "ms": 2.03}]
    empty = tmp_path / "cpu.json"
    empty.write_text(json.dumps({"traceEvents": events[-1:]}))
    proc = subprocess.run([sys.executable, str(BENCH / "trace_gaps.py"), str(empty)], capture_output=True, text=True)
    assert proc.returncode != 0 and "no GPU kernels" in proc.stderr
    two = tmp_path / "two.json"  # a second GPU's kernel: named, then left out with --device
    two.write_text(json.dumps({"traceEvents": events + [{"cat": "kernel", "name": "d", "ts": 20, "dur": 900,
                                                         "args": {"device": 1}}]}))
    proc = subprocess.run([sys.executable, str(BENCH / "trace_gaps.py"), str(two)], capture_output=True, text=True)
    assert proc.returncode != 0 and "GPUs [0, 1]" in proc.stderr
    _run([sys.executable, str(BENCH / "trace_gaps.py"), str(two), "--device", "0", "--json", str(out)], tmp_path)
    assert json.loads(out.read_text())["before"] == got["before"]


def test_compiled_calls_times_the_three_ways_of_running_the_layers(tmp_path):
    """benchmarks/compiled_calls.py's plumbing (dynamo's eager backend, 2 layers): a step under each mode, and
    the per-call estimate from the per-layer and stacked steps."""
    out = tmp_path / "calls.json"
    _run(_py("compiled_calls.py", "--layers", "2", "--reps", "1", "--backend", "eager", "--json", str(out)), tmp_path,
         timeout=300)
    got = _json(out, "modes", "ms_per_call", "backend")
    assert set(got["modes"]) == {"eager", "layers", "stack"} and got["backend"] == "eager"
    assert all(r["step_ms"] > 0 for r in got["modes"].values())


def test_replay_speed_times_both_ways_on_equal_runs(tmp_path):
    """benchmarks/replay_speed.py's plumbing (the tiny target): the replay one prompt at a time and packed, timed, with
    the same runs for every prompt."""
    out = tmp_path / "replay.json"
    _run(_py("replay_speed.py", "--prompts", "4", "--json", str(out)), tmp_path, timeout=300)
    got = _json(out, "one_at_a_time_s", "packed_s", "prompts_equal")
    assert got["prompts_equal"] == 4 and got["one_at_a_time_s"] > 0 and got["packed_s"] > 0
