"""profile-report over a profile.jsonl written by the real producers (stats -> window_record -> verdict)."""

import json

import pytest

from dflash_train.errors import UsageError
from dflash_train.profiling.report import load_records, report, summarize
from dflash_train.profiling.stats import ProfileStats
from dflash_train.profiling.summary import window_record
from dflash_train.profiling.verdict import attach_verdict

WINDOW_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def target_window(stats: ProfileStats, full_wait_s: float) -> None:
    prof = stats.loop("target")
    for _ in range(10):
        prof.add("batch_queue_wait", 0.01)
        prof.add("target_forward", 0.3)
        prof.add("hs_queue_full_wait", full_wait_s)
    prof.count("tokens", 40_000)
    prof.gauge("hs_queue_depth", 4)


def drafter_window(stats: ProfileStats) -> None:
    prof = stats.loop("drafter")
    for _ in range(10):
        prof.add("hs_queue_wait", 0.02)
        prof.add("drafter_forward", 0.7)
        prof.add("drafter.L0.attention", 0.2)
        prof.add("backward", 0.2)
    prof.count("tokens", 40_000)
    prof.gauge("hs_queue_depth", 3)
    prof.gauge("hs_queue_depth", 4)


def take(stats: ProfileStats) -> dict:
    return attach_verdict(window_record(stats, stats.take_window()))


@pytest.fixture
def run_dir(tmp_path):
    clock = FakeClock()
    target = ProfileStats("rank0/target/cpu", clock=clock)
    drafter = ProfileStats("rank1/drafter/cpu", clock=clock)
    lines = []
    # The first target window is balanced, then the drafter falls behind for three windows.
    for full_wait_s in (0.05, 0.5, 0.5, 0.5):
        target_window(target, full_wait_s)
        drafter_window(drafter)
        clock.now += WINDOW_S
        lines += [json.dumps(take(target)), json.dumps(take(drafter))]
    lines.append(json.dumps({"type": "other", "loops": {}}))  # not a profile record
    lines.append(lines[0][: len(lines[0]) // 2])  # torn by a killed writer
    (tmp_path / "profile.jsonl").write_text("\n".join(lines))
    return tmp_path


def test_load_records_skips_torn_and_foreign_lines(run_dir):
    records = load_records(run_dir / "profile.jsonl")
    assert len(records) == 8
    assert {r["process"] for r in records} == {"rank0/target/cpu", "rank1/drafter/cpu"}


def test_report_text_and_png(run_dir):
    text, png = report(run_dir)
    for name in ("rank0/target/cpu", "rank1/drafter/cpu", "[target]", "[drafter]",
                 "target_forward", "hs_queue_full_wait", "drafter_forward", "drafter.L0.attention", "backward",
                 "tokens_per_s", "hs_queue_depth", "balanced", "drafter-bound"):
        assert name in text, name
    # Three consecutive drafter-bound windows collapse into one line.
    assert "t=20s..40s  drafter-bound (x3 windows)" in text
    # Cumulative hs_queue_full_wait: 10 * (0.05 + 3 * 0.5) = 15.5 s of 40 s profiled.
    row = next(line for line in text.splitlines() if line.strip().startswith("hs_queue_full_wait"))
    assert row.split()[1:3] == ["40", "15.50"] and row.endswith("38.8%")
    assert png == run_dir / "profile.png"
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")


def test_report_to_custom_path(run_dir, tmp_path):
    out = tmp_path / "figs" / "p.png"
    _, png = report(run_dir, out)
    assert png == out and out.read_bytes().startswith(b"\x89PNG")


def test_summarize_matches_report_text(run_dir):
    assert summarize(load_records(run_dir / "profile.jsonl")) == report(run_dir)[0]


def test_missing_file_names_path(tmp_path):
    with pytest.raises(UsageError) as err:
        report(tmp_path)
    assert str(tmp_path / "profile.jsonl") in str(err.value)
    assert "--profile-interval" in str(err.value)


def test_file_without_records_names_path(tmp_path):
    (tmp_path / "profile.jsonl").write_text('{"type": "profile", "loops": {}\n')  # torn only
    with pytest.raises(UsageError, match="no profile records") as err:
        report(tmp_path)
    assert str(tmp_path / "profile.jsonl") in str(err.value)


def test_report_shows_min_busy_columns_and_allocator(tmp_path):
    clock, cpu = FakeClock(), FakeClock()
    snaps = iter([{"num_device_alloc": 4, "num_device_free": 0, "reserved_bytes.all.current": 3 << 30},
                  {"num_device_alloc": 6, "num_device_free": 1, "reserved_bytes.all.current": 2 << 30}])
    stats = ProfileStats("main/cuda:0", clock=clock, cpu_clock=cpu, memory_stats=lambda: next(snaps))
    prof = stats.loop("drafter")
    lines = []
    for ms in ((4, 2), (6, 3)):  # two windows: the min is over both
        for m in ms:
            with prof.span("backward"):
                clock.now += m / 1e3
                cpu.now += m / 2e3  # on-CPU half the time
        prof.add("hs_queue_wait", 0.001)
        clock.now += 1
        lines.append(json.dumps(take(stats)))
    (tmp_path / "profile.jsonl").write_text("\n".join(lines))
    text, _ = report(tmp_path)
    assert "min ms" in text and "host" in text and "dev" in text and "starved" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("backward")).split()
    assert row[1:4] == ["4", "0.02", "3.75"] and row[4] == "2.00" and row[-4:-1] == ["50%", "-", "-"]
    wait = next(line for line in text.splitlines() if line.strip().startswith("hs_queue_wait")).split()
    assert wait[-4:-1] == ["-", "-", "-"]
    assert ("allocator (sum over windows): alloc_retries 0, device_allocs 6, device_frees 1 "
            "| max reserved 3.00 GiB | max allocated 0.00 GiB") in text


class NoDeviceEvent:
    """torch.cuda.Event without a device: every span takes no device time."""

    def __init__(self, enable_timing=False) -> None:
        pass

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end) -> float:
        return 0.0


def test_report_pools_the_starved_counts_over_windows(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", NoDeviceEvent)
    clock, drained = FakeClock(), iter([True, False, False, False])
    stats = ProfileStats("main/cuda:0", cuda_events=True, clock=clock, cpu_clock=FakeClock(),
                         stream_drained=lambda: next(drained))
    prof = stats.loop("drafter")
    lines = []
    for spans in (1, 3):  # window 1: 1 of 1 start drained (100%); window 2: 0 of 3
        for _ in range(spans):
            with prof.span("backward", device=True):
                clock.now += 0.001
        clock.now += 1
        lines.append(json.dumps(take(stats)))
    (tmp_path / "profile.jsonl").write_text("\n".join(lines))
    text, _ = report(tmp_path)
    head = next(line for line in text.splitlines() if line.strip().startswith("stage")).split()
    assert head[-3:] == ["dev", "starved", "share"]
    row = next(line for line in text.splitlines() if line.strip().startswith("backward")).split()
    assert row[-2] == "25%"  # 1 of 4 starts over the run, not the mean of the windows' shares (50%)


def test_the_report_sums_the_windows_compiles_and_says_where_they_fell():
    clock = FakeClock()
    stats = ProfileStats("main", clock=clock)
    records = []
    for compiled in ({"graphs": 4, "seconds": 37.9, "cache_hits": 1, "cache_misses": 7}, None,
                     {"graphs": 1, "seconds": 0.4}):  # a record from before the cache counts
        drafter_window(stats)
        clock.now += WINDOW_S
        rec = window_record(stats, stats.take_window())
        if compiled:
            rec["compiles"] = compiled
        records.append(attach_verdict(rec))
    assert [r["verdict"]["kind"] for r in records][:2] == ["compiling", "balanced"]
    assert ("compiles (sum over windows): 5 graphs, 38.3 s (38 s at 10 s); Inductor's disk cache: 1 of 8 "
            "Inductor graphs found") in summarize(records)
