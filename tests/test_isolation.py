"""One test leaves nothing behind for the next: torch's process-wide (from 2.13, per-thread) settings come back
after each test (conftest.torch_state_restored), whatever the test did to them."""

import subprocess
import sys

import pytest
import torch
import torch._dynamo.config as dynamo_config
from conftest import _torch_state, restore_torch_state


@pytest.mark.slow
def test_the_compile_tests_leave_torchs_config_whole_for_the_next_compiled_test():
    """The compile tests patch torch's config; a compiled FlexAttention after them read a setting that a
    deleted-and-not-restored key had broken (`recompile_limit does not exist`, raised inside torch)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_compiled.py",
                           "tests/test_objective.py::test_compiled_flex_compiles_once"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_settings_a_test_deleted_or_changed_come_back():
    """pytest's monkeypatch undoes a patch of torch's config by deleting the setting (torch keeps none in the
    module's __dict__), which hides it from then on; the restore puts it back, with the other changes."""
    before = _torch_state()
    limit, verbose = dynamo_config.recompile_limit, dynamo_config.verbose
    mp = pytest.MonkeyPatch()
    mp.setattr(dynamo_config, "recompile_limit", limit + 1)
    mp.undo()
    dynamo_config.verbose = not verbose
    torch.set_default_dtype(torch.float64)
    restore_torch_state(before)
    assert dynamo_config.recompile_limit == limit and dynamo_config.verbose == verbose
    assert torch.get_default_dtype() == torch.float32
