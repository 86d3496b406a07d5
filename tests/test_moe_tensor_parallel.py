"""The experts' kernels of a target split by tensor parallelism (CPU, gloo): each rank's local expert slices
give the whole target's features under every kernel."""

from __future__ import annotations

import os
import sys
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_train.data.packing import pack
from dflash_train.models.experts import use_experts
from dflash_train.models.sharded_loading import load_sharded_target
from dflash_train.pipeline.features import packed_features

SPEC = "random:tiny-qwen3-moe"  # 16 experts of width 32: 16 columns of each a rank
LAYERS = [1, 3, 5]
KERNELS = ("eager", "grouped_mm", "dflash_grouped")


def _batch():
    rng = np.random.default_rng(0)
    return pack([(rng.integers(0, 256, n), np.ones(n, dtype=np.int64)) for n in (23, 9, 31)], 1 << 20)


def _count_grouped_gemms() -> list[int]:
    """Counts torch's grouped GEMM calls from now on in this (worker) process."""
    owner, name = (torch.nn.functional, "grouped_mm") if hasattr(torch.nn.functional, "grouped_mm") \
        else (torch, "_grouped_mm")
    real, calls = getattr(owner, name), [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    setattr(owner, name, counted)
    return calls


def _worker(rank: int, world: int, rdv: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
    try:
        target = load_sharded_target(SPEC, dist.group.WORLD, "cpu", dtype=torch.float32)
        calls = _count_grouped_gemms()
        feats, grouped = {}, {}
        for kernel in KERNELS:
            use_experts(target.model, kernel)
            before = calls[0]
            feats[kernel] = packed_features(target, _batch(), LAYERS)
            grouped[kernel] = calls[0] - before
        experts = target.decoder.layers[0].mlp.experts.gate_up_proj.to_local().shape
        torch.save({"feats": feats, "experts": experts, "grouped": grouped}, os.path.join(out, f"rank{rank}.pt"))
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    sys.stdout.flush()  # no interpreter teardown with gloo's threads alive (as tests/test_tensor_parallel.py)
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_tp2_features_under_each_kernel_equal_the_whole_targets(tmp_path):
    mp.start_processes(_worker, args=(2, str(tmp_path / "rdv"), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    whole = load_sharded_target(SPEC, None, "cpu", dtype=torch.float32)  # the same weights, unsplit
    assert use_experts(whole.model, "eager") == "eager"
    ref = packed_features(whole, _batch(), LAYERS)
    for r in ranks:
        assert r["experts"] == (16, 32, 64)  # [E, 2I/2, H]: half of every expert's gate and up rows
        assert r["grouped"]["eager"] == 0 and r["grouped"]["grouped_mm"] > 0  # the kernel asked for ran
        assert r["grouped"]["dflash_grouped"] == 0  # float32 weights: its per-expert loop
        for kernel in KERNELS:
            torch.testing.assert_close(r["feats"][kernel], ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, k=kernel: f"{k}: {m}")
