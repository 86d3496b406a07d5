"""The multi-process pipeline on CPU (gloo): equivalence with one device, queue bounds, failures, stops."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_train.cli import main
from dflash_train.models.checkpoint import load_drafter
from dflash_train.training.checkpoint import latest_checkpoint, load_state

BASE = ["train", "--target", "random:tiny", "--max-length", "96", "--token-budget", "192", "--num-anchors", "16",
        "--block-size", "4", "--eval-limit", "0", "--log-every", "1", "--quiet", "--seed", "3"]
THREE = ["--target-devices", "cpu", "--drafter-devices", "cpu,cpu"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_three_processes_reproduce_the_single_device_losses(prepared, tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    one, three = tmp_path / "one", tmp_path / "three"
    # One device with 2 packs per step == 2 drafter workers with 1 pack each (DDP averages their gradients).
    assert main([*BASE, "--data", prepared, "--run-dir", str(one), "--device", "cpu", "--grad-accum", "2",
                 "--max-steps", "8"]) == 0
    assert main([*BASE, "--data", prepared, "--run-dir", str(three), *THREE, "--max-steps", "8",
                 "--queue-depth", "2", "--profile-interval", "0.5"]) == 0
    a, b = _records(one / "metrics.jsonl"), _records(three / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]),
                               rtol=1e-4, atol=1e-5)
    assert all(r["target_tokens_per_s"] > 0 and r["block_tokens_per_s"] > 0 for r in b)
    assert (three / "drafter" / "model.safetensors").is_file()

    # Every process profiled; no queue ever held more than --queue-depth items.
    profiles = _records(three / "profile.jsonl")
    assert {p["process"] for p in profiles} == {"rank0/target/cpu", "rank1/drafter/cpu", "rank2/drafter/cpu"}
    depths = [g["max"] for p in profiles for loop in p["loops"].values() for k, g in loop["gauges"].items()
              if k.endswith("_depth")]
    assert depths and max(depths) <= 2


@pytest.mark.slow
def test_feature_scale_through_three_processes(prepared, tmp_path):
    """--feature-scale rms (the default) with two drafter workers: one scale, the first worker's first pack's (a
    broadcast), which is the one a single device with 2 packs a step measures; kept in the trainer state, and the
    checkpoint's fc has it folded in."""
    three, one = tmp_path / "three", tmp_path / "one"
    assert main([*BASE, "--data", prepared, "--run-dir", str(three), *THREE, "--max-steps", "2"]) == 0
    assert main([*BASE, "--data", prepared, "--run-dir", str(one), "--device", "cpu", "--grad-accum", "2",
                 "--max-steps", "1"]) == 0
    ckpt = latest_checkpoint(three)
    scale = load_state(ckpt)["feature_scale"]
    exported = load_drafter(ckpt / "drafter", dtype=torch.float32)
    assert scale.shape == exported.fc.weight.shape[1:] and bool((scale > 0).all()) and scale.std() > 0
    assert torch.equal(scale, load_state(latest_checkpoint(one))["feature_scale"])


@pytest.mark.slow
def test_distillation_through_three_processes_equals_one_device(prepared, tmp_path, monkeypatch):
    """--kd-weight: the target workers send one more layer (its final hidden states) and the
    drafter workers distil from it; the losses equal the one-device run's, and differ from hard labels."""
    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    runs = {"hard": [], "one": ["--device", "cpu", "--grad-accum", "2", "--kd-weight", "0.5"],
            "three": [*THREE, "--kd-weight", "0.5"]}
    for name, flags in runs.items():
        extra = ["--device", "cpu", "--grad-accum", "2"] if name == "hard" else flags
        assert main([*BASE, "--data", prepared, "--run-dir", str(tmp_path / name), "--max-steps", "4", *extra]) == 0
    loss = {name: torch.tensor([r["loss"] for r in _records(tmp_path / name / "metrics.jsonl")]) for name in runs}
    torch.testing.assert_close(loss["three"], loss["one"], rtol=1e-4, atol=1e-5)
    assert (loss["one"] - loss["hard"]).abs().min() > 1e-4  # every step, 10x the runs' agreement above


@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
def test_cached_features_train_identically_and_skip_the_target_after_epoch_one(prepared, tmp_path, monkeypatch,
                                                                                overlap):
    """--cache-features: later epochs read each sequence's features back instead of running the target,
    inline or on the target thread, and the losses are those of the uncached run."""
    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    common = [*BASE, "--data", prepared, "--device", "cpu", "--epochs", "3", "--profile-interval", "0.2"]
    assert main([*common, "--run-dir", str(tmp_path / "plain"), "--no-overlap", "--no-cache-features"]) == 0
    assert main([*common, "--run-dir", str(tmp_path / "cached"), overlap, "--cache-features"]) == 0
    loss = {k: torch.tensor([r["loss"] for r in _records(tmp_path / k / "metrics.jsonl")]) for k in ("plain", "cached")}
    torch.testing.assert_close(loss["cached"], loss["plain"], rtol=1e-5, atol=1e-6)

    def forwards(run: str) -> int:  # target forwards actually run (a cached pack never enters packed_features)
        return sum(p["loops"].get("target", {}).get("stages", {}).get("target_forward", {}).get("count", 0)
                   for p in _records(tmp_path / run / "profile.jsonl"))

    steps = len(loss["plain"])
    assert forwards("plain") == steps and 0 < forwards("cached") <= steps // 3 + 1


def test_a_feature_cache_that_cannot_fit_the_gpu_keeps_what_fits_and_says_so(capsys):
    """The shipped H200 config's first cache (7.71M tokens x 5 x 576 bf16 = 44 GB) fits beside 90 GB to
    spare; with 15.6 GB it keeps 15.6 GB of them, and says so."""
    from dflash_train.app.local import cache_budget

    assert cache_budget(7_709_379, 5 * 576 * 2, room=90 * 10**9, working=40 * 10**9) is None
    assert cache_budget(7_709_379, 5 * 576 * 2, room=int(15.6e9), working=40 * 10**9) == int(15.6e9)
    assert "take 44.4 GB; beside the run's 40.0 GB of working memory (measured) 15.6 GB fit: keeping 35%" \
        in capsys.readouterr().err
    assert cache_budget(7_709_379, 5 * 576 * 2, room=-10**9, working=90 * 10**9) == 0  # no room: keeps nothing


def test_a_gpu_feature_cache_is_sized_by_the_working_memory_of_the_first_steps(monkeypatch, tmp_path):
    """A GPU's cache takes its budget once the drafter has taken its first optimizer step (the queue's depth,
    the step's packs and two more): what the peak of those steps leaves of the free memory and the
    reservation, less a 10% margin. A worker caches the packs it serves or trains on: with 4 of them a
    44 GB cache is ~11 GB each, which fits."""
    from types import SimpleNamespace

    from dflash_train.app.local import feature_cache
    from dflash_train.pipeline.target_features import FeatureSpec
    from dflash_train.settings.tree import TrainConfig

    gpu = SimpleNamespace(device=torch.device("cuda", 0), hidden_size=576, dtype=torch.bfloat16)
    resets, retries, emptied = [], [0], []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: resets.append(device))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * 10**9, 80 * 10**9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * 10**9)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 46 * 10**9)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device: {"num_alloc_retries": retries[0]})
    cfg = TrainConfig.of(run_dir=str(tmp_path), cache_features=True, queue_depth=2, grad_accum=3)
    spec = FeatureSpec((1, 8, 14, 20, 27))
    cache = feature_cache(cfg, gpu, 7_709_379, spec)
    assert resets == [gpu.device]  # the peak is the training's, from here on
    assert cache.unsized == 2 + 3 + 2 and cache.budget is None
    assert cache.size() == 40e9 + 30e9 - 46e9 - 8e9 and emptied  # 16 GB of the 44.4, unused blocks handed back
    assert not cache.short()  # the allocator has retried no cudaMalloc since the cache began
    retries[0] += 1
    assert cache.short() and not cache.short()  # one retry since: said once
    assert feature_cache(cfg, gpu, 7_709_379, spec, share=4).size() is None  # 11.1 GB fit
    off = TrainConfig.of(run_dir=str(tmp_path), cache_features=False)
    assert feature_cache(off, gpu, 7_709_379, spec) is None


def test_a_measured_cache_keeps_its_first_packs_then_holds_to_its_budget(tiny_target, prepared, capsys):
    """The packs before the budget are kept; the budget, once taken, trims what they hold beyond it; a
    retry from those first steps (compile, first allocations) is not a shortage."""
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.pipeline.feature_cache import FeatureCache
    from dflash_train.pipeline.features import target_features
    from dflash_train.pipeline.stream import PackStream
    from dflash_train.pipeline.target_features import FeatureSpec

    packs = list(PackStream(PreparedDataset.open(prepared), 160, 4, 0, 1).packs(20))
    spec = FeatureSpec((0, 1))
    compute = lambda p: target_features(tiny_target, p.batch, spec)  # noqa: E731
    width = spec.token_bytes(tiny_target.hidden_size, tiny_target.dtype)
    sized, released, retried = [], [], [True]  # a retry pending from the measured steps
    cache = FeatureCache(size=lambda: sized.append(cache.bytes) or 150 * width, sized_after=3,
                         short=lambda: retried.pop() if retried else False, release=lambda: released.append(1))
    for n, pack in enumerate(packs):
        held = cache.bytes
        cache.features(pack, compute)
        if n < 3:
            assert cache.bytes > held and not sized  # kept, unbudgeted
    assert len(sized) == 1 and sized[0] == sum(p.num_tokens for p in packs[:3]) * width
    assert sized[0] > 150 * width >= cache.bytes > 0 and released  # trimmed to the budget
    assert "ran short" not in capsys.readouterr().err


def test_a_cache_over_budget_keeps_some_sequences_and_gives_every_pack_its_features(tiny_target, prepared):
    """Packs of cached and uncached sequences: the uncached ones go through the target on their own, and
    each pack's features are those the target gives the whole pack; the cache stays within its budget."""
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.pipeline.feature_cache import FeatureCache
    from dflash_train.pipeline.features import target_features
    from dflash_train.pipeline.stream import PackStream
    from dflash_train.pipeline.target_features import FeatureSpec

    packs = list(PackStream(PreparedDataset.open(prepared), 160, 4, 0, 1).packs(40))  # epochs packed anew
    spec = FeatureSpec((0, 1), labels=True)  # the labels are cached and counted with the hidden states
    compute = lambda p: target_features(tiny_target, p.batch, spec)  # noqa: E731
    width_bytes = spec.token_bytes(tiny_target.hidden_size, tiny_target.dtype)
    cache = FeatureCache(budget_bytes=200 * width_bytes)  # about a third of the data's tokens
    calls = []
    for pack in packs:
        got = cache.features(pack,
                             lambda p, whole=pack.num_tokens: calls.append((p.batch.num_tokens, whole)) or compute(p))
        want = compute(pack)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-6)
        assert got.labels.tolist() == want.labels.tolist()
    assert 0 < cache.bytes <= 200 * width_bytes
    assert 0 < len(cache.parts) < len({i for p in packs for i in p.sequence_ids})
    assert any(0 < ran < whole for ran, whole in calls)  # packs of both kinds: only their uncached sequences ran
    assert sum(ran for ran, _ in calls) < sum(p.batch.num_tokens for p in packs)  # cached tokens did not run again


def test_a_cache_gives_memory_back_when_the_device_runs_short(tiny_target, prepared, capsys):
    """When the allocator had to retry a cudaMalloc, the cache gives back a tenth of its bytes (the
    sequences it kept first), grows no more, and every pack still gets the target's features."""
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.pipeline.feature_cache import FeatureCache
    from dflash_train.pipeline.features import target_features
    from dflash_train.pipeline.stream import PackStream
    from dflash_train.pipeline.target_features import FeatureSpec

    packs = list(PackStream(PreparedDataset.open(prepared), 160, 4, 0, 1).packs(40))
    spec = FeatureSpec((0, 1))
    compute = lambda p: target_features(tiny_target, p.batch, spec)  # noqa: E731
    calls = iter(range(len(packs)))
    cache = FeatureCache(short=lambda: next(calls) == 12)
    kept = []
    for n, pack in enumerate(packs):
        got = cache.features(pack, compute)
        torch.testing.assert_close(got.hidden, compute(pack).hidden, rtol=1e-5, atol=1e-6)
        kept.append((cache.bytes, len(cache.parts)))
        if n == 11:
            first = next(iter(cache.parts))
    before = kept[11][0]
    assert 0 < kept[12][0] <= 0.9 * before < kept[12][0] + max(p.nbytes for p in cache.parts.values())
    assert first not in cache.parts  # the first kept went first
    assert all(b <= kept[12][0] for b, _ in kept[12:])  # grows no more
    assert "the GPU ran short of memory; the feature cache gave back" in capsys.readouterr().err


def test_the_batch_producer_pins_packs_only_for_a_cuda_consumer(prepared):
    """Pinned packs let a CUDA step's copies queue behind the previous step (from pageable memory CUDA
    synchronizes the stream first); a CPU run's packs stay as they are (pinning needs CUDA)."""
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.pipeline.stream import PackStream
    from dflash_train.pipeline.target_loop import BatchQueue

    def first(pin: bool):
        batches = BatchQueue(PackStream(PreparedDataset.open(prepared), 192, 16, 0, 1).packs(1), 2, pin=pin)
        try:
            return next(iter(batches))
        finally:
            batches.close()

    plain = first(False)
    assert not plain.batch.input_ids.is_pinned()
    if torch.cuda.is_available():
        pinned = first(True)
        tensors = [pinned.anchors, *(t for t in vars(pinned.batch).values() if t is not None)]
        assert all(t.is_pinned() for t in tensors)
        assert torch.equal(pinned.batch.input_ids, plain.batch.input_ids) and torch.equal(pinned.anchors, plain.anchors)


def test_a_pack_stream_counts_the_tokens_of_an_epoch(prepared):
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.pipeline.stream import PackStream

    data = PreparedDataset.open(prepared)
    assert PackStream(data, 4096, 4, 0, 1).tokens() == int(data.lengths().sum())


@pytest.mark.slow
def test_a_pipeline_per_device_reproduces_the_single_device_losses(prepared, tmp_path, monkeypatch):
    """The same list to both flags: each process holds a target and a drafter; only gradients cross."""
    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    one, both = tmp_path / "one", tmp_path / "both"
    assert main([*BASE, "--data", prepared, "--run-dir", str(one), "--device", "cpu", "--grad-accum", "2",
                 "--max-steps", "6"]) == 0
    assert main([*BASE, "--data", prepared, "--run-dir", str(both), "--target-devices", "cpu,cpu",
                 "--drafter-devices", "cpu,cpu", "--max-steps", "6", "--profile-interval", "0.5"]) == 0
    a, b = _records(one / "metrics.jsonl"), _records(both / "metrics.jsonl")
    torch.testing.assert_close(torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]),
                               rtol=1e-4, atol=1e-5)
    profiles = _records(both / "profile.jsonl")
    assert {p["process"] for p in profiles} == {"rank0/both/cpu", "rank1/both/cpu"}
    assert all(set(p["loops"]) <= {"target", "drafter"} for p in profiles)
    assert any("target_forward" in p["loops"].get("target", {}).get("stages", {}) for p in profiles)


def _start(args: list[str], **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash_train.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ | env)


def _workers(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "spawn_main"], capture_output=True, text=True).stdout
    return sorted(int(x) for x in out.split())


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has finished


def _wait_for_training(proc: subprocess.Popen, run_dir: Path, timeout: float = 120) -> list[int]:
    """The worker pids, once the first metrics record exists."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and metrics.read_text().strip():
            workers = _workers(proc.pid)
            assert len(workers) == 3
            return workers
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("training did not start")


def _wait_for_workers(proc: subprocess.Popen, n: int, timeout: float = 60) -> list[int]:
    """The worker pids as soon as all n have started (the fault below may end one before training logs)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        workers = _workers(proc.pid)
        if len(workers) == n:
            return workers
        time.sleep(0.05)
    raise AssertionError(f"the {n} workers did not start")


@pytest.mark.slow
def test_raising_in_a_target_worker_ends_the_run(prepared, tmp_path):
    proc = _start([*BASE, "--data", prepared, "--run-dir", str(tmp_path), *THREE, "--max-steps", "100000"],
                  DFLASH_TRAIN_FAULT="target:30")
    # Not "once training logs": a target worker (its features cached after the first epoch, its sends
    # buffered by gloo) can reach pack 30 and fail before the drafters write their first record.
    workers = _wait_for_workers(proc, 3)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "injected fault in the target loop at pack 30" in err  # the worker's own traceback
    assert "rank 0 (target, cpu) exited with code 1" in err
    assert not any(_running(p) for p in workers)


@pytest.mark.slow
def test_raising_in_the_target_of_a_pipeline_per_device_ends_the_run(prepared, tmp_path):
    proc = _start([*BASE, "--data", prepared, "--run-dir", str(tmp_path), "--target-devices", "cpu,cpu",
                   "--drafter-devices", "cpu,cpu", "--max-steps", "100000"], DFLASH_TRAIN_FAULT="target:30")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "injected fault in the target loop at pack 30" in err
    assert "(both, cpu) exited with code 1" in err


@pytest.mark.slow
def test_a_stopped_worker_is_named_when_progress_stalls(prepared, tmp_path):
    """SIGSTOP of a drafter worker: after --peer-timeout the run ends naming that worker, not the
    target that stalled behind it."""
    proc = _start([*BASE, "--data", prepared, "--run-dir", str(tmp_path), *THREE, "--max-steps", "100000",
                   "--peer-timeout", "30"])  # above the start-up time of 3 CPU workers, on a busy host too
    # (at 15 s a full-suite run beside other work on 2 cores stalled at start-up, 2026-12-01)
    workers = _wait_for_training(proc, tmp_path)
    os.kill(workers[-1], signal.SIGSTOP)  # ranks start in order: the last is drafter rank 2
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # normally the launcher has killed it by now
            os.kill(workers[-1], signal.SIGCONT)
    assert proc.returncode != 0
    assert "worker rank 2 (drafter, cpu) is stopped (SIGSTOP or a debugger)" in err


@pytest.mark.slow
def test_kill_9_of_a_drafter_worker_ends_the_run_within_30s(prepared, tmp_path):
    proc = _start([*BASE, "--data", prepared, "--run-dir", str(tmp_path), *THREE, "--max-steps", "100000"])
    workers = _wait_for_training(proc, tmp_path)
    os.kill(workers[-1], signal.SIGKILL)  # ranks start in order: the last is drafter rank 2
    t0 = time.time()
    _, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 30
    assert proc.returncode != 0
    assert "rank 2 (drafter, cpu) was killed by signal 9" in err
    time.sleep(0.5)
    assert not any(_running(p) for p in workers)


@pytest.mark.slow
def test_sigterm_stops_after_a_checkpoint(prepared, tmp_path):
    proc = _start([*BASE, "--data", prepared, "--run-dir", str(tmp_path), *THREE, "--max-steps", "100000",
                   "--checkpoint-every", "0"])
    workers = _wait_for_training(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert int(latest.removeprefix("step_")) >= 1
    assert not any(_running(p) for p in workers)

    # ... and the run resumes from it.
    assert main([*BASE, "--data", prepared, "--run-dir", str(tmp_path), *THREE, "--resume",
                 "--max-steps", str(int(latest.removeprefix("step_")) + 2)]) == 0


@pytest.mark.slow
def test_torchrun_launch_trains_with_the_same_role_split(prepared, tmp_path):
    """Under torchrun each process takes (role, device) = the lists' entry at LOCAL_RANK."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "dflash_train.cli", *BASE, "--data", prepared, "--run-dir", str(run), *THREE, "--max-steps", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in _records(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (run / "drafter" / "model.safetensors").is_file()

    bad = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "dflash_train.cli", *BASE, "--data", prepared, "--run-dir", str(tmp_path / "bad"),
                          *THREE], capture_output=True, text=True, timeout=180)
    assert bad.returncode != 0
    assert "--nproc-per-node must be 3" in bad.stderr


def test_data_without_any_anchor_is_a_usage_error():
    import numpy as np

    from dflash_train.errors import UsageError
    from dflash_train.pipeline.stream import PackStream

    class NoAssistant:
        def __len__(self):
            return 3

        def lengths(self):
            return np.array([10, 10, 10])

        def __getitem__(self, i):
            return np.arange(10), np.zeros(10, dtype=np.int64)

    with pytest.raises(UsageError, match="two consecutive"):
        PackStream(NoAssistant(), 20, 4, 0, 1).next_step()


def test_a_target_thread_that_runs_out_of_packs_fails_the_drafter_instead_of_hanging(tiny_target, prepared):
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.pipeline.sources import ThreadedSource
    from dflash_train.pipeline.stream import PackStream
    from dflash_train.pipeline.target_features import FeatureSpec

    packs = PackStream(PreparedDataset.open(prepared), 192, 16, 0, 1).packs(1)  # one step's packs, then the end
    source = ThreadedSource(tiny_target, packs, FeatureSpec((0, 1)), depth=2)
    try:
        assert source.get().features.num_tokens > 0
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="pack stream ended before the drafter's last step"):
            source.get()
        assert time.monotonic() - t0 < 5
    finally:
        source.close()
    assert not source.thread.is_alive()
