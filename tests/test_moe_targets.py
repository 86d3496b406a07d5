"""Mixture-of-experts targets: the experts' kernel (models/experts.py) and their FLOPs counted on active parameters."""

import json

import numpy as np
import pytest
import torch
from conftest import cli_error

from dflash_train.cli import main
from dflash_train.data.packing import pack
from dflash_train.decode import architectures
from dflash_train.errors import UsageError
from dflash_train.models import presets
from dflash_train.models.experts import resolve, use_experts
from dflash_train.models.loading import load_target
from dflash_train.models.memory_plan import parameter_counts
from dflash_train.pipeline.features import packed_features
from dflash_train.profiling.flops import Shape, shape_of, target_flops

MOE = ["tiny-qwen3-moe", "tiny-gpt-oss"]
LAYERS = [1, 3, 5]  # the tiny presets have 6 layers; 5 gets the final norm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=MOE)
def moe_target(request):
    return load_target(f"random:{request.param}", device="cpu", dtype=torch.float32, seed=0)


def _batch():
    rng = np.random.default_rng(0)
    return pack([(rng.integers(0, 256, n), np.ones(n, dtype=np.int64)) for n in (37, 5, 60)], 1 << 20)


class _GroupedMMCalls:
    """Counts torch's grouped GEMM calls: the kernel transformers' grouped_mm experts run."""

    def __init__(self, monkeypatch):
        self.n = 0
        owner, name = (torch.nn.functional, "grouped_mm") if hasattr(torch.nn.functional, "grouped_mm") \
            else (torch, "_grouped_mm")
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            self.n += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)


def test_auto_is_dflash_grouped_for_bf16_on_cuda_and_eager_elsewhere():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve("auto", cuda, torch.bfloat16) == "dflash_grouped"
    assert resolve("auto", cuda, torch.float32) == "eager"  # the CUDA grouped GEMMs take bf16
    assert resolve("auto", cpu, torch.bfloat16) == "eager"  # the reference (docs/performance.md#moe-targets)
    assert resolve("grouped_mm", cpu, torch.float32) == "grouped_mm"


def test_loading_sets_auto_on_moe_targets_and_leaves_dense_ones(moe_target, tiny_target):
    assert moe_target.config._experts_implementation == "eager"  # auto on CPU, never "auto" itself
    before = tiny_target.config._experts_implementation
    assert use_experts(tiny_target.model, "grouped_mm") is None
    assert tiny_target.config._experts_implementation == before


@pytest.mark.parametrize("kernel", ["grouped_mm", "batched_mm", "dflash_grouped"])
def test_features_under_each_kernel_equal_eager(moe_target, kernel, monkeypatch):
    """The features DFlash trains on do not depend on the kernel, within float32 rounding."""
    batch = _batch()
    calls = _GroupedMMCalls(monkeypatch)
    try:
        assert use_experts(moe_target.model, "eager") == "eager"
        want = packed_features(moe_target, batch, LAYERS)
        assert calls.n == 0
        assert use_experts(moe_target.model, kernel) == kernel
        got = packed_features(moe_target, batch, LAYERS)
    finally:
        use_experts(moe_target.model)
    assert (calls.n > 0) == (kernel == "grouped_mm")  # the kernel asked for is the one that ran
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", MOE)
def test_train_regenerates_trains_and_evaluates_on_an_moe_target(preset, tmp_path, capsys):
    """The whole job, the drafter started from the target (a routed MLP has no dense counterpart to copy)."""
    run = tmp_path / "run"
    assert main(["train", "--target", f"random:{preset}", "--device", "cpu", "--data-topic", "any",
                 "--num-conversations", "4", "--regen-max-new-tokens", "8", "--max-steps", "2", "--max-length", "128",
                 "--token-budget", "256", "--num-anchors", "8", "--block-size", "4", "--eval-limit", "1",
                 "--eval-max-new-tokens", "8", "--run-dir", str(run), "--quiet"]) == 0
    assert json.loads((run / "eval_after.json").read_text())["lossless"] == "exact"
    assert (run / "drafter" / "model.safetensors").is_file() and len(list(run.glob("regenerated-*.jsonl"))) == 1


@pytest.mark.parametrize("kernel", ["grouped_mm", "dflash_grouped"])
def test_the_train_job_applies_the_pipeline_setting(kernel):
    from dflash_train.app.train import job_target
    from dflash_train.settings.tree import TrainConfig

    cfg = TrainConfig.of(target="random:tiny-gpt-oss", target_experts=kernel)
    assert job_target(cfg, torch.device("cpu")).config._experts_implementation == kernel


def test_an_unknown_kernel_is_one_line_naming_the_flag(moe_target, capsys, tmp_path):
    want = r"^--target-experts must be auto, eager, grouped_mm, batched_mm or dflash_grouped, got 'x'$"
    with pytest.raises(UsageError, match=want):
        use_experts(moe_target.model, "x")
    assert "--target-experts must be" in cli_error(["train", "--run-dir", str(tmp_path), "--target-experts",
                                                    "fused"], capsys)
    assert "--target-experts must be comma-separated" in cli_error(["bench", "--target-experts", "eager,fused"],
                                                                   capsys)
    assert "--splits runs one experts kernel" in cli_error(["bench", "--target-experts", "eager,grouped_mm",
                                                            "--splits", "x2"], capsys)


def test_gpt_oss_steps_are_capturable_unless_its_experts_loop_on_the_host():
    """decode/architectures.py: the eager loop finds each expert's tokens with a host read; the others do not."""
    target = load_target("random:tiny-gpt-oss", device="cpu", dtype=torch.float32)
    # dflash_grouped loops over the experts on the host for float32 weights (its CUDA GEMMs take bf16)
    want = {"eager": False, "grouped_mm": True, "batched_mm": True, "dflash_grouped": False}
    for kernel, capturable in want.items():
        use_experts(target.model, kernel)
        assert architectures.capturable(target.model) is capturable


def test_moe_flops_count_the_router_and_the_top_k_experts_by_hand():
    """tiny-qwen3-moe: 16 experts of width 32, 4 a token; tiny-gpt-oss: 8 of width 64, 2 a token."""
    h, attn = 64, 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v, o: 4 heads and 2 KV heads of 16
    assert shape_of(presets.hf_config("tiny-qwen3-moe")).layer_params(6) == 6 * (attn + h * 16 + 3 * h * 4 * 32)
    assert shape_of(presets.hf_config("tiny-gpt-oss")).layer_params(6) == 6 * (attn + h * 8 + 3 * h * 2 * 64)
    dense = Shape(hidden=h, intermediate=128, heads=4, kv_heads=2, head_dim=16)
    assert dense.layer_params(3) == 3 * (attn + 3 * h * 128)
    assert target_flops(dense, 3, [4]) == 2 * dense.layer_params(3) * 4 + 3 * dense.attn_pair * 10


def test_qwen3_moe_dense_layers_count_a_dense_mlp():
    cfg = presets.hf_config("tiny-qwen3-moe")
    cfg.mlp_only_layers, cfg.decoder_sparse_step = [0], 2  # layers 1, 3, 5 route; 0, 2, 4 are dense
    mlp = shape_of(cfg).mlp
    assert mlp[0] == mlp[2] == 3 * 64 * 128 and mlp[1] == mlp[3] == 64 * 16 + 3 * 64 * 4 * 32


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "qwen3-235b-a22b"])
def test_target_flops_count_active_parameters(name):
    """The target's FLOPs per token are 2 x its active decoder parameters (memory_plan's count, less the
    embedding and the LM head; the norms and biases FLOPs leave out are under 0.1% at these sizes), not
    its total, which has 8x (gpt-oss-20b) to 16x (Qwen3-30B-A3B) the experts' share."""
    cfg = presets.hf_config(name)
    counts = parameter_counts(cfg)
    head = 0 if cfg.tie_word_embeddings else counts.embedding
    active = counts.active - counts.embedding - head
    layer_params = shape_of(cfg).layer_params(cfg.num_hidden_layers)
    assert layer_params == pytest.approx(active, rel=2e-3)
    assert layer_params < 0.5 * (counts.total - counts.embedding - head)
    assert target_flops(shape_of(cfg), cfg.num_hidden_layers, [1]) == pytest.approx(
        2 * active + cfg.num_hidden_layers * shape_of(cfg).attn_pair, rel=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE)
def test_bench_runs_each_kernel_side_by_side(name, tmp_path):
    """--target-experts eager,grouped_mm,dflash_grouped: every variant under each, named variant@kernel, with the
    kernel run."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", f"random:{name}", "--device", "cpu", "--num-layers", "1", "--block-size", "4",
                 "--num-anchors", "8", "--seq-len", "64", "--steps", "1", "--variants", "target-only,overlap",
                 "--target-experts", "eager,grouped_mm,dflash_grouped", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    kernels = ("eager", "grouped_mm", "dflash_grouped")
    runs = {f"{v}@{k}": k for v in ("target-only", "overlap") for k in kernels}
    assert set(res["variants"]) == set(runs)
    assert all(res["variants"][run]["experts"] == kernel for run, kernel in runs.items())
    assert res["best_variant"] in {f"overlap@{k}" for k in kernels}
    assert res["target_tflop_per_step"] > 0 and res["time_to_first_step_s"] > 0
