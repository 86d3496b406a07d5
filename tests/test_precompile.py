"""--precompile: the drafter's training step built from a JSON spec in a process of its own (on a CPU eager:
the plumbing; on CUDA the same step compiled, filling the compile caches the job then hits)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_train.app import precompile
from dflash_train.app.drafter import planned_config
from dflash_train.settings.tree import TrainConfig


def _spec(tiny_target, **flags) -> dict:
    cfg = TrainConfig.of(**{"device": "cpu", "num_layers": 2, "block_size": 4, "token_budget": 128, "max_length": 64,
                            "num_anchors": 4, **flags})
    return json.loads(json.dumps(precompile.spec_of(cfg, planned_config(cfg, tiny_target, None), tiny_target)))


def test_the_spec_builds_the_jobs_step_and_runs_it(tiny_target):
    spec = _spec(tiny_target)
    assert spec["drafter"]["num_hidden_layers"] == 2 and spec["vocab"] == tiny_target.embedding_weight.shape[0]
    assert torch.isfinite(torch.tensor(precompile.run(spec)))
    kd = _spec(tiny_target, kd_weight=0.5)  # distillation: the features carry the target's last layer too
    assert torch.isfinite(torch.tensor(precompile.run(kd)))


def test_nothing_starts_off_cuda_or_without_compiled_layers(tiny_target):
    cfg = TrainConfig.of(device="cpu", precompile=True)
    assert precompile.start(cfg, lambda: pytest.fail("no config is needed"), tiny_target) is None
    precompile.finish(None)
    precompile.stop(None)


@pytest.mark.parametrize("stack", [False, True])
def test_the_packs_compiled_ahead_leave_nothing_to_compile_for_the_data(tiny_target, stack):
    """The graphs precompile's packs compile are the ones packs of real data run: none of those compiles another.
    At the SmolLM2 recipe's ratio (anchors x B = --max-length, 128 x 8 = 1,024; here 32 x 4 = 128) a pack of
    equal sequences made FlexAttention's tile counts equal, torch.compile specialized on them, and the data
    compiled anew. Forward only: FlexAttention has no CPU backward."""
    import torch._dynamo
    from torch._dynamo.testing import EagerAndRecordGraphs
    from torch._dynamo.utils import counters

    from dflash_train.data.synthetic import SyntheticSequences
    from dflash_train.models.config import DFlashConfig
    from dflash_train.models.factory import new_drafter
    from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig, feature_layer_ids
    from dflash_train.pipeline.stream import PackStream

    spec = _spec(tiny_target, token_budget=1024, max_length=128, num_anchors=32, attention="flex",
                 sliding_layers=1, sliding_window=64)
    dcfg = DFlashConfig.from_reference_dict(spec["drafter"])
    drafter = new_drafter(dcfg, 0).float().eval()
    obj = DFlashObjective(drafter, tiny_target.embedding_weight, tiny_target.lm_head,
                          ObjectiveConfig(**spec["objective"]))
    width = len(feature_layer_ids(dcfg, False)) * tiny_target.hidden_size
    lengths = np.random.default_rng(7).integers(5, 129, size=40)  # conversations of any length up to the window
    data = list(PackStream(SyntheticSequences(40, 128, 200, 7, lengths), 1024, 32, 7, 1).packs(3))
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), drafter.compiled_layers(backend=EagerAndRecordGraphs(), stack=stack):
        for n, pack in enumerate(precompile.packs(spec) + data):
            if n == precompile.PACKS:
                ahead = counters["stats"]["unique_graphs"]
            obj(pack.batch, pack.anchors, torch.randn(pack.batch.num_tokens, width))
    assert counters["stats"]["unique_graphs"] == ahead == (1 if stack else 2)  # (full and sliding layer graphs)


@pytest.mark.slow
def test_the_process_runs_the_spec(tiny_target, tmp_path):
    path = tmp_path / precompile.SPEC_FILE
    path.write_text(json.dumps(_spec(tiny_target)))
    src = str(Path(precompile.__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-m", "dflash_train.app.precompile", str(path)], capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"precompile: {precompile.PACKS} steps compiled and run" in proc.stdout


@pytest.mark.parametrize("code, last, said", [
    (0, "precompile: one step in 9 s; Inductor's disk cache: 0 of 6 Inductor graphs found\n[W] a warning at exit",
     "s of them; one step in 9 s; Inductor's disk cache: 0 of 6 Inductor graphs found)"),
    (3, "boom", "exit 3 (boom); the training compiles")])
def test_finish_says_how_it_went_and_removes_its_folder(tmp_path, capsys, code, last, said):
    folder = tmp_path / "ahead"
    folder.mkdir()
    log = open(folder / precompile.LOG_FILE, "w")
    process = subprocess.Popen([sys.executable, "-c", f"print({last!r}); raise SystemExit({code})"], stdout=log)
    log.close()
    precompile.finish(precompile.Handle(process, 0.0, folder))
    assert said in capsys.readouterr().err and not folder.exists()
