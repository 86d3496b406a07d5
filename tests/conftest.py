import time

import numpy as np
import pytest
import torch

from dflash_train.models.factory import drafter_config_for, new_drafter
from dflash_train.models.targets import load_target


@pytest.fixture(scope="session")
def tiny_target():
    return load_target("random:tiny", device="cpu", dtype=torch.float32, seed=0)


@pytest.fixture(scope="session")
def prepared(tiny_target, tmp_path_factory):
    """24 short conversations prepared for the tiny target: the multi-process pipeline tests' data."""
    from dflash_train.data.dataset import prepare_dataset
    from dflash_train.data.sources import Conversation

    root = tmp_path_factory.mktemp("pipeline")
    convs = [Conversation(f"c{i}", [{"role": "user", "content": f"question {i}: " + "abc " * (i % 5 + 1)},
                                    {"role": "assistant", "content": f"answer {i} " * (3 + i % 7)}])
             for i in range(24)]
    prepare_dataset(tiny_target.tokenizer, convs, root / "data", max_length=96)
    return str(root / "data")


@pytest.fixture
def make_drafter(tiny_target):
    """An untrained float32 drafter for the tiny target."""

    def make(num_layers=2, block_size=4, seed=1, **kw):
        cfg = drafter_config_for(tiny_target, num_layers=num_layers, block_size=block_size, dtype="float32", **kw)
        return new_drafter(cfg, seed).float().eval()

    return make


@pytest.fixture
def perturb_norms():
    """Norm weights away from one (a fresh drafter has them all at one), so a skipped or swapped norm shows."""

    def perturb(drafter, seed=0):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "norm" in name:
                    p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
        return drafter

    return perturb


class InMemoryDataset:
    """(ids, loss_mask) pairs as a dataset: the pack stream needs only lengths() and indexing."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def lengths(self):
        return np.array([len(ids) for ids, _ in self.pairs])

    def __getitem__(self, i):
        return self.pairs[i]


@pytest.fixture
def in_memory_dataset():
    return InMemoryDataset


@pytest.fixture
def reference_timing(monkeypatch):
    """The reference decode loop times itself with torch.cuda.synchronize; on CPU use the plain clock."""
    import dflash.model as ref

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    return ref
