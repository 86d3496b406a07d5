"""The benchmark's FLOP accounting and the bench command on CPU."""

import json

import torch

from dflash_train.bench.flops import Shape, drafter_flops, target_flops
from dflash_train.cli import main
from dflash_train.objective.blocks import PackedBatch, build_blocks
from dflash_train.objective.masks import MaskSpec, dense_mask


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


def test_bench_split_errors_name_the_flag(capsys):
    for split, why in (("2-1", "is not T+D"), ("0+1", "is not T+D"), ("1+1", "on CPU equal lists")):
        assert main(["bench", "--target", "random:tiny", "--device", "cpu", "--splits", split]) == 2
        err = capsys.readouterr().err
        assert "--splits" in err and why in err
