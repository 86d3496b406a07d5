import json
import os
import random
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo.config
import torch._inductor.config

from dflash_train.models.factory import drafter_config_for, new_drafter
from dflash_train.models.loading import load_target


def pytest_addoption(parser):
    parser.addoption("--test-order", default="file", metavar="ORDER",
                     help="file (as collected), reverse, or shuffle:SEED: run the tests in another order to show "
                          "what one test leaves behind for the next (scripts/test_orders.sh)")


def pytest_collection_modifyitems(config, items):
    order = config.getoption("--test-order")
    if order == "reverse":
        items.reverse()
    elif order.startswith("shuffle:"):
        random.Random(int(order.split(":", 1)[1])).shuffle(items)
    elif order != "file":
        raise pytest.UsageError(f"--test-order: {order!r} is not file, reverse or shuffle:SEED")


_CONFIGS = (torch._dynamo.config, torch._inductor.config)
_DELETED = object()


def _torch_state():
    """What a test could leave changed for every later test in this process (and thread)."""
    return {"configs": [c.get_config_copy() for c in _CONFIGS], "dtype": torch.get_default_dtype(),
            "threads": torch.get_num_threads(), "grad": torch.is_grad_enabled()}


def _same(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # values without a plain truth value (tensors, arrays): compare by identity
        return False


def restore_torch_state(before: dict) -> None:
    """Put back what `_torch_state` saw: only the settings that differ now, or that a test deleted."""
    with warnings.catch_warnings():  # reading every setting reads the deprecated ones too
        warnings.simplefilter("ignore")
        for config, saved in zip(_CONFIGS, before["configs"], strict=True):
            for key, value in saved.items():  # key by key: a deleted setting makes torch's whole-config copy raise
                now = getattr(config, key, _DELETED)
                if now is _DELETED or not _same(now, value):
                    setattr(config, key, value)
    if torch.get_num_threads() != before["threads"]:
        torch.set_num_threads(before["threads"])
    torch.set_default_dtype(before["dtype"])
    torch.set_grad_enabled(before["grad"])


@pytest.fixture(autouse=True)
def torch_state_restored():
    """Each test starts from the state the one before it found. The product sets some of torch's config on
    purpose (models/compiled.py); a test that patched a setting away (pytest's monkeypatch deletes what it
    did not find in a module's __dict__, where torch's config keeps nothing) broke every compiled test after it."""
    before = _torch_state()
    yield
    restore_torch_state(before)


def cli_error(argv: list[str], capsys) -> str:
    """Run the CLI: it must exit 2 with one `dflash-train: error:` line (the last, after a run's progress
    lines) and no traceback. Returns that line without its prefix."""
    from dflash_train.cli import main

    code = main(argv)
    out = capsys.readouterr().err.strip()
    err = (out.splitlines() or [""])[-1]
    assert code == 2, out
    assert err.startswith("dflash-train: error:") and "Traceback" not in out, out
    return err.removeprefix("dflash-train: error: ")


def _triton_interprets_the_kernels() -> bool:
    """triton's interpreter runs the decode kernels from 3.8 (3.6's fails on numpy 2.5: "only 0-dimensional arrays
    can be converted to Python scalars", seen on the H200 image); the CUDA tests run on the GPU either way."""
    try:
        import triton
    except ImportError:
        return False
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)


# a test that runs a decode kernel under triton's interpreter (run_interpreted)
interpreted = pytest.mark.skipif(not _triton_interprets_the_kernels(),
                                 reason="needs triton >= 3.8, whose interpreter runs the decode kernels")


def run_interpreted(code: str, timeout: float = 600) -> str:
    """Run `code` in a child python under triton's interpreter (TRITON_INTERPRET=1, chosen when triton is
    imported: hence a process of its own), the tests' directory importable; fail with its stderr unless it
    exits 0. Returns its stdout."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def write_conversations(path, n: int = 12):
    """`n` two-turn conversations, numbers in the questions and answers, as JSONL at `path`."""
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i} about numbers"},
        {"role": "assistant", "content": f"the answer to {i} is {i * 7}, plainly"}]}) + "\n" for i in range(n)))
    return path


@pytest.fixture
def good(tmp_path):
    """good.jsonl: six short two-turn conversations."""
    path = tmp_path / "good.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i} " * 6}]}) + "\n"
        for i in range(6)))
    return path


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny matmuls: too small to split, extra threads only add sync
    overhead, and on a busy shared CPU they made such tests ~40x slower. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
