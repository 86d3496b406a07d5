"""The benchmark's FLOP accounting and the bench command on CPU."""

import json
import os
from pathlib import Path

import pytest
import torch

from dflash_train.cli import main
from dflash_train.data.packing import PackedBatch
from dflash_train.objective.blocks import build_blocks
from dflash_train.objective.masks import MaskSpec, dense_mask
from dflash_train.profiling.flops import Shape, drafter_flops, target_flops


def test_attention_pairs_are_the_masks_allowed_entries():
    """drafter_flops counts B * sum(pos(a) + B) (query, key) pairs: exactly the mask's True entries."""
    seq = torch.tensor([0] * 7 + [1] * 5)
    pos = torch.cat([torch.arange(7), torch.arange(5)])
    batch = PackedBatch(torch.arange(12), torch.ones(12, dtype=torch.long), seq, pos)
    anchors = torch.tensor([1, 4, 8, 10])
    B = 3
    blocks = build_blocks(batch, anchors, B, mask_token_id=0, gamma=2.0)
    allowed = int(dense_mask(MaskSpec.of(batch, blocks)).sum())
    shape = Shape(hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4)
    with_attn = drafter_flops(shape, 1, 1, 10, B, 12, pos[anchors])
    assert allowed == B * int((pos[anchors] + B).sum())
    attn = 3 * shape.attn_pair * allowed
    linear = 6 * shape.linear_params * len(anchors) * B + 6 * shape.kv_params * 12
    fc = 4 * 1 * 8 * 8 * 12
    head = 4 * 8 * 10 * len(anchors) * (B - 1)
    assert with_attn == attn + linear + fc + head


def test_target_flops_counts_causal_pairs():
    shape = Shape(hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4)
    assert target_flops(shape, 2, [3, 2]) == 2 * (2 * shape.linear_params * 5 + shape.attn_pair * (6 + 3))


@pytest.mark.slow
def test_bench_command_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", "random:tiny", "--device", "cpu", "--num-layers", "1", "--block-size", "4",
                 "--num-anchors", "8", "--seq-len", "64", "--steps", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("tokens_per_s", "mfu", "vs_sequential", "time_to_first_step_s", "peak_memory_gb", "device", "date",
                "versions", "command", "profile_overhead_wall", "profile_overhead_cuda"):
        assert key in res
    assert set(res["variants"]) == {"sequential", "overlap", "overlap+wall", "overlap+cuda", "target-only",
                                    "drafter-only"}
    assert res["tokens_per_s"] > 0 and res["model_tflop_per_step"] > 0
    assert "drafter_forward" in res["variants"]["overlap+wall"]["profile"]["drafter"]
    for v in ("overlap+wall", "overlap+cuda"):  # the profiled variants carry their verdicts
        assert res["variants"][v]["verdict"]["kind"] == res["variants"][v]["verdicts"][-1]
        assert "host_busy" in res["variants"][v]["profile"]["drafter"]["drafter_forward"]
    assert "verdict" not in res["variants"]["overlap"]


@pytest.mark.slow
def test_cold_start_gives_each_variant_process_empty_compile_caches(monkeypatch):
    from dflash_train.bench.run import _compile_caches, _in_fresh_process

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/warm")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    with _compile_caches(True):
        seen = _in_fresh_process(os.getenv, "TORCHINDUCTOR_CACHE_DIR")
        assert seen != "/warm" and Path(seen).parent.is_dir() and not Path(seen).exists()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/warm" and "TRITON_CACHE_DIR" not in os.environ
    with _compile_caches(False):
        assert _in_fresh_process(os.getenv, "TORCHINDUCTOR_CACHE_DIR") == "/warm"


@pytest.mark.slow
def test_bench_splits_run_the_multi_process_pipeline_on_cpu(tmp_path):
    """--splits: T+D processes over gloo and xN whole pipelines, with verdicts and scaling against one device."""
    out = tmp_path / "multi.json"
    assert main(["bench", "--target", "random:tiny", "--device", "cpu", "--num-layers", "1", "--block-size", "4",
                 "--num-anchors", "8", "--seq-len", "64", "--steps", "2", "--variants", "overlap",
                 "--splits", "1+2,x2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("gpus", "split", "tokens_per_s", "mfu", "scaling_efficiency", "device", "date", "command"):
        assert key in res
    assert set(res["splits"]) == {"1+2", "x2"}
    assert res["splits"]["1+2"]["gpus"] == 3 and res["splits"]["x2"]["gpus"] == 2
    assert all(r["tokens_per_s"] > 0 and r["verdict"] for r in res["splits"].values())
    assert set(res["by_gpus"]) == {"2", "3"} and res["gpus"] == 3
    assert res["scaling_efficiency"] == res["tokens_per_s"] / (3 * res["one_gpu"]["tokens_per_s"])
    rec = res["recommendation"]
    assert set(rec["2"]["predicted_tokens_per_s"]) == {"x2", "1+1"}
    assert set(rec["3"]["predicted_tokens_per_s"]) == {"x3", "1+2", "2+1"}
    assert rec["3"]["measured_best"] == "1+2" and rec["2"]["measured_best"] == "x2"


def _split(targets: str, drafters: str, tokens: float, t_cap: float, d_cap: float) -> dict:
    return {"gpus": len(set((targets + "," + drafters).split(","))), "target_devices": targets,
            "drafter_devices": drafters, "tokens_per_s": tokens, "target_capacity_tokens_per_s": t_cap,
            "drafter_capacity_tokens_per_s": d_cap}


def test_recommendation_predicts_each_split_from_the_role_rates():
    """T+D delivers min(T x target rate, D x drafter rate), xN N x the one-GPU rate; checked against measurement."""
    from dflash_train.bench.multi import recommend

    splits = {"1+1": _split("cuda:0", "cuda:1", 17.0, 25.0, 17.0),
              "x2": _split("cuda:0,cuda:1", "cuda:0,cuda:1", 25.0, 21.0, 25.0),
              "1+3": _split("cuda:0", "cuda:1,cuda:2,cuda:3", 25.0, 25.0, 51.0)}
    rec = recommend(13.0, splits)
    assert rec["rates_per_gpu"] == {"both": 13.0, "target": 25.0, "drafter": 17.0}
    assert rec["2"] == {"recommended": "x2", "predicted_tokens_per_s": {"x2": 26.0, "1+1": 17.0},
                        "measured_best": "x2", "confirmed": True}
    assert rec["4"]["predicted_tokens_per_s"] == {"x4": 52.0, "1+3": 25.0, "2+2": 34.0, "3+1": 17.0}
    assert rec["4"]["recommended"] == "x4" and rec["4"]["confirmed"] is None  # x4 was not measured
    # Faster drafters per GPU than the colocated pipeline: the split wins the prediction.
    assert recommend(5.0, splits)["2"]["recommended"] == "1+1"
    assert recommend(5.0, splits)["2"]["confirmed"] is False
    # nothing to check: only xN could be predicted (no T+D split measured), or no one-GPU rate for x2
    only_x2 = recommend(13.0, {"x2": splits["x2"]})
    assert only_x2["2"]["recommended"] == "x2" and only_x2["2"]["confirmed"] is None
    assert recommend(None, splits)["2"]["confirmed"] is None


def test_split_verdict_ignores_one_role_processes_that_cannot_see_the_queue():
    from dflash_train.bench.multi import split_verdict

    assert split_verdict({"rank0/target/cuda:0": ["balanced", "drafter-bound", "drafter-bound"],
                          "rank1/drafter/cuda:1": ["balanced"] * 5}) == "drafter-bound"
    assert split_verdict({"rank0/target/cuda:0": ["balanced"], "rank1/drafter/cuda:1": ["balanced"]}) == "balanced"
    assert split_verdict({"rank0/both/cuda:0": ["balanced", "balanced", "drafter-bound"]}) == "balanced"
    assert split_verdict({"rank0/target/cuda:0": ["idle"]}) == "idle"
    # one stray window in a process decides nothing
    assert split_verdict({"rank0/target/cuda:0": ["balanced"] * 9 + ["drafter-bound"],
                          "rank1/drafter/cuda:1": ["balanced"] * 10}) == "balanced"
    assert split_verdict({"rank0/target/cuda:0": ["balanced"] * 10,
                          "rank1/drafter/cuda:1": ["balanced"] * 9 + ["target-bound"]}) == "balanced"


def test_bench_split_errors_name_the_flag(capsys):
    for split, why in (("2-1", "is not T+D"), ("0+1", "is not T+D"), ("1+1", "on CPU equal lists")):
        assert main(["bench", "--target", "random:tiny", "--device", "cpu", "--splits", split]) == 2
        err = capsys.readouterr().err
        assert "--splits" in err and why in err


@pytest.mark.slow
def test_a_recipe_shaped_bench_trains_that_drafter_on_packs_of_several_sequences(tmp_path):
    """--token-budget packs several --seq-len sequences a step (as real data does), and the drafter flags
    shape the drafter every variant trains: a wider MLP costs FLOPs, sliding layers reach the train run."""
    from dflash_train.bench.config import BenchConfig, train_config

    cfg = BenchConfig(target="random:tiny", device="cpu", num_layers=2, block_size=4, num_anchors=8, seq_len=64,
                      token_budget=256, steps=2, intermediate_size=96, sliding_layers=1, variants="drafter-only",
                      num_key_value_heads=4)
    tcfg = train_config(cfg, tmp_path, "drafter-only", 4)
    assert (tcfg.data.token_budget, tcfg.data.max_length) == (256, 64)
    assert (tcfg.drafter.intermediate_size, tcfg.drafter.sliding_layers, tcfg.drafter.num_key_value_heads) == (96, 1, 4)
    out = tmp_path / "bench.json"
    argv = ["bench", "--target", "random:tiny", "--device", "cpu", "--num-layers", "2", "--block-size", "4",
            "--num-anchors", "8", "--seq-len", "64", "--steps", "2", "--variants", "drafter-only"]
    argv += ["--token-budget", "256", "--sliding-layers", "1", "--json", str(out)]
    assert main([*argv, "--intermediate-size", "96"]) == 0
    wide = json.loads(out.read_text())["variants"]["drafter-only"]
    assert wide["tokens_per_s"] * wide["step_s"] == pytest.approx(256)  # four sequences a step
    assert main([*argv, "--intermediate-size", "48"]) == 0
    narrow = json.loads(out.read_text())["variants"]["drafter-only"]
    assert wide["model_tflop_per_step"] > narrow["model_tflop_per_step"]


def test_a_bench_token_budget_below_one_sequence_is_refused(capsys):
    assert main(["bench", "--target", "random:tiny", "--device", "cpu", "--seq-len", "64", "--token-budget", "32"]) == 2
    assert "--token-budget 32" in capsys.readouterr().err
