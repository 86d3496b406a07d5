"""The pipeline across two GPUs over NCCL: the role split and the pipeline per GPU give one GPU's losses.

Skipped without two CUDA devices (CI has none); run on a two-GPU host with NCCL_NVLS_ENABLE=0.
"""

import json
from pathlib import Path

import pytest
import torch

from dflash_train.cli import main

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

BASE = ["train", "--target", "random:tiny", "--max-length", "96", "--token-budget", "192", "--num-anchors", "16",
        "--block-size", "4", "--eval-limit", "0", "--log-every", "1", "--quiet", "--seed", "3", "--max-steps", "6"]


def _losses(run_dir: Path) -> torch.Tensor:
    return torch.tensor([json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()])


def _one_gpu(prepared, run_dir: Path, accum: int) -> torch.Tensor:
    assert main([*BASE, "--data", prepared, "--run-dir", str(run_dir), "--device", "cuda:0",
                 "--grad-accum", str(accum)]) == 0
    return _losses(run_dir)


# bf16 autocast: the same kernels on two GPUs of one kind, but NCCL's all-reduce sums in another order
TOL = {"rtol": 2e-3, "atol": 2e-3}


def test_features_over_nccl_reproduce_one_gpu(prepared, tmp_path, monkeypatch):
    """1 target GPU + 1 drafter GPU: features cross by NCCL point-to-point, unchanged."""
    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    one = _one_gpu(prepared, tmp_path / "one", 1)
    assert main([*BASE, "--data", prepared, "--run-dir", str(tmp_path / "split"), "--target-devices", "cuda:0",
                 "--drafter-devices", "cuda:1", "--profile-interval", "0.5"]) == 0
    torch.testing.assert_close(_losses(tmp_path / "split"), one, **TOL)
    processes = {json.loads(x)["process"] for x in (tmp_path / "split" / "profile.jsonl").read_text().splitlines()}
    assert processes == {"rank0/target/cuda:0", "rank1/drafter/cuda:1"}
    assert (tmp_path / "split" / "drafter" / "model.safetensors").is_file()


def test_a_pipeline_per_gpu_reproduces_one_gpu_with_accumulation(prepared, tmp_path, monkeypatch):
    """Both roles on each GPU, gradients averaged by DDP over NCCL == one GPU with 2 packs per step."""
    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    one = _one_gpu(prepared, tmp_path / "one", 2)
    assert main([*BASE, "--data", prepared, "--run-dir", str(tmp_path / "x2"), "--target-devices", "cuda:0,cuda:1",
                 "--drafter-devices", "cuda:0,cuda:1"]) == 0
    torch.testing.assert_close(_losses(tmp_path / "x2"), one, **TOL)
