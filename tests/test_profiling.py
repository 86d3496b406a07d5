"""ProfileStats, summaries, verdicts, the interval setting and the no-op path."""

import contextlib
import gc
import json

import pytest
import torch

from dflash_train.errors import UsageError
from dflash_train.profiling.reporter import ProfileReporter, resolve_interval
from dflash_train.profiling.stats import NULL_PROFILE, ProfileStats
from dflash_train.profiling.summary import format_record, window_record
from dflash_train.profiling.verdict import attach_verdict, verdict


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _timed(prof, clock, key, seconds):
    with prof.span(key):
        clock.t += seconds


def test_span_statistics_from_a_mocked_clock():
    clock = Clock()
    stats = ProfileStats("p", clock=clock)
    prof = stats.loop("drafter")
    for ms in range(1, 101):  # 1..100 ms
        _timed(prof, clock, "drafter_forward", ms / 1000)
    prof.add("hs_queue_wait", 0.5)
    prof.count("tokens", 1000)
    prof.gauge("hs_queue_depth", 1)
    prof.gauge("hs_queue_depth", 3)
    clock.t = 110.0  # a 10 s window
    rec = window_record(stats, stats.take_window())
    s = rec["loops"]["drafter"]["stages"]["drafter_forward"]
    assert s["count"] == 100
    assert s["mean_ms"] == pytest.approx(50.5)
    assert s["p50_ms"] == pytest.approx(50.5)
    assert s["p95_ms"] == pytest.approx(95.05)
    assert s["max_ms"] == pytest.approx(100.0)
    assert s["total_s"] == pytest.approx(5.05)
    assert s["share"] == pytest.approx(0.505)
    assert rec["loops"]["drafter"]["stages"]["hs_queue_wait"]["share"] == pytest.approx(0.05)
    assert rec["loops"]["drafter"]["rates"]["tokens_per_s"] == pytest.approx(100.0)
    assert rec["loops"]["drafter"]["gauges"]["hs_queue_depth"] == {"mean": 2.0, "max": 3.0, "last": 3.0}
    assert rec["window_s"] == pytest.approx(10.0)

    # The next window starts empty; cumulative values carry on.
    _timed(prof, clock, "drafter_forward", 0.2)
    clock.t += 1
    rec2 = window_record(stats, stats.take_window())
    assert rec2["loops"]["drafter"]["stages"]["drafter_forward"]["count"] == 1
    cum = rec2["loops"]["drafter"]["cumulative"]
    assert cum["stages"]["drafter_forward"]["count"] == 101
    assert cum["stages"]["drafter_forward"]["total_s"] == pytest.approx(5.25)
    assert cum["counters"]["tokens"] == 1000


@contextlib.contextmanager
def _collector_off():
    """Python's collector paused: a collection inside a window adds its optional "gc" record (and past 10 ms or a
    full one, a summary line), which tests of a record's exact keys or lines would otherwise meet by chance."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_jsonl_schema_and_log_lines(tmp_path):
    clock = Clock()
    with _collector_off():
        stats = ProfileStats("rank0/target/cpu", clock=clock)
        prof = stats.loop("target")
        _timed(prof, clock, "target_forward", 0.03)
        prof.add("hs_queue_full_wait", 0.06)
        clock.t += 0.01
        lines = []
        rep = ProfileReporter(stats, 60, tmp_path, log=lines.append, tensorboard=False)
        rep.emit()
    (rec,) = [json.loads(x) for x in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert set(rec) == {"type", "time", "elapsed_s", "process", "mode", "window_s", "loops", "verdict"}
    assert rec["type"] == "profile" and rec["mode"] == "wall" and rec["process"] == "rank0/target/cpu"
    assert set(rec["loops"]["target"]) == {"stages", "counters", "rates", "gauges", "cumulative"}
    assert set(rec["loops"]["target"]["stages"]["target_forward"]) == {
        "count", "mean_ms", "p50_ms", "p95_ms", "max_ms", "total_s", "share"} | {
        "min_ms", "wall_s", "cpu_s", "host_busy"}  # the min and a span's clocks (no CUDA: no device)
    assert rec["verdict"]["kind"] == "drafter-bound"
    text = lines[0]
    assert "target_forward" in text and "p95 ms" in text and "max ms" in text and "verdict: drafter-bound" in text
    assert rep.emit() is None  # an empty window writes nothing


def _record(**shares):
    loops = {}
    for key, share in shares.items():
        loop, stage = key.split("__")
        loops.setdefault(loop, {"stages": {}})["stages"][stage] = {"share": share}
    return {"loops": loops}


@pytest.mark.parametrize("shares, kind", [
    ({"target__batch_queue_wait": 0.4, "target__target_forward": 0.5, "drafter__hs_queue_wait": 0.6}, "input-bound"),
    ({"target__hs_queue_full_wait": 0.41, "target__target_forward": 0.5, "drafter__drafter_forward": 0.9},
     "drafter-bound"),
    ({"target__target_forward": 0.95, "drafter__hs_queue_wait": 0.35, "drafter__backward": 0.4}, "target-bound"),
    ({"target__handoff": 0.3, "target__target_forward": 0.6}, "handoff-bound"),
    ({"target__target_forward": 0.7, "drafter__hs_queue_wait": 0.2, "drafter__backward": 0.6}, "balanced"),
    ({}, "idle"),
])
def test_verdicts_from_synthetic_profiles(shares, kind):
    v = verdict(_record(**shares))
    assert v.kind == kind
    assert v.message.startswith(kind)


def test_verdict_message_names_the_wait_and_the_remedy():
    v = attach_verdict(_record(target__hs_queue_full_wait=0.41))["verdict"]
    assert v["message"].startswith("drafter-bound: target workers wait 41% on a full hs_queue")
    assert "add drafter devices" in v["message"]


def test_a_window_that_compiles_says_so_and_its_verdict_is_compiling():
    """torch.compile's graphs and seconds land in the window they happened in, and only there; a window
    that spent a quarter of its time compiling is judged 'compiling', whatever it waited on."""
    from dflash_train.profiling.compiles import compile_window, format_compiles

    assert compile_window({"graphs": 3, "seconds": 10.0}, {"graphs": 3, "seconds": 10.0}) is None
    assert compile_window({"graphs": 3, "seconds": 10.0},
                          {"graphs": 5, "seconds": 48.25}) == {"graphs": 2, "seconds": 38.25, "cache_hits": 0,
                                                               "cache_misses": 0}
    cold = compile_window({"graphs": 3, "seconds": 10.0, "cache_hits": 4, "cache_misses": 0},
                          {"graphs": 5, "seconds": 61.5, "cache_hits": 4, "cache_misses": 2})
    assert cold == {"graphs": 2, "seconds": 51.5, "cache_hits": 0, "cache_misses": 2}
    assert format_compiles(cold).endswith("; Inductor's disk cache: 0 of 2 Inductor graphs found")
    clock = Clock()
    stats = ProfileStats("main", clock=clock)
    prof = stats.loop("drafter")
    f = torch.compile(lambda x: x.sin() * 2, backend="eager")
    with prof.span("drafter_forward"):
        f(torch.randn(7))
    clock.t += 1.0
    rec = attach_verdict(window_record(stats, stats.take_window()))
    assert rec["compiles"]["graphs"] >= 1 and rec["compiles"]["seconds"] > 0
    assert "compiles: +" in format_record(rec)
    with prof.span("drafter_forward"):
        f(torch.randn(7))  # compiled already: nothing new
    clock.t += 1.0
    assert "compiles" not in window_record(stats, stats.take_window())
    waiting = {**_record(target__hs_queue_full_wait=0.6), "window_s": 30.0}
    assert verdict(waiting).kind == "drafter-bound"
    v = verdict({**waiting, "compiles": {"graphs": 2, "seconds": 20.5}})
    assert v.kind == "compiling" and "20.5 s" in v.message
    assert verdict({**waiting, "compiles": {"graphs": 1, "seconds": 2.0}}).kind == "drafter-bound"


def test_a_full_garbage_collection_lands_in_its_window_and_the_run_report():
    """A gen-2 collection is counted in the window it ran in, with its pause, and only there; a window where
    nothing was collected has no record of it, and one with a few quick collections prints no line."""
    from dflash_train.profiling.gc_pauses import gc_window, worth_a_line
    from dflash_train.profiling.report import summarize

    quiet = {"collections": [5, 1, 0], "seconds": 0.002}
    assert gc_window(quiet, quiet, []) is None
    assert not worth_a_line(gc_window({"collections": [0, 0, 0], "seconds": 0.0}, quiet, []))
    assert gc_window(quiet, {"collections": [9, 1, 1], "seconds": 0.252}, [0.25]) == {
        "collections": [4, 0, 1], "seconds": 0.25, "full_max_ms": 250.0}
    clock = Clock()
    stats = ProfileStats("main", clock=clock)
    prof = stats.loop("drafter")
    with prof.span("drafter_forward"):
        gc.collect()
    clock.t += 1.0
    rec = attach_verdict(window_record(stats, stats.take_window()))
    assert rec["gc"]["collections"][2] >= 1 and rec["gc"]["seconds"] > 0
    assert "full)" in format_record(rec)
    assert "gc (sum over windows)" in summarize([rec])
    with prof.span("drafter_forward"):
        pass
    clock.t += 1.0
    quiet = window_record(stats, stats.take_window())  # young collections may run: never the full one again
    assert quiet.get("gc", {"collections": [0, 0, 0]})["collections"][2] == 0


STAT = """cpu  1000 0 500 8000 100 0 0 0 0 0
cpu0 500 0 250 4000 50 0 0 0 0 0
cpu1 500 0 250 4000 50 0 0 0 0 0
intr 12345
"""


def test_host_load_reads_proc_and_says_when_the_rest_of_the_machine_is_busy():
    """/proc/stat's busy ticks (idle and iowait left out) over all ticks, times the CPUs, against this process's
    CPU seconds over the wall clock; the summary line only when the rest of the machine used a CPU or more."""
    from dflash_train.profiling import host_load
    from dflash_train.profiling.report import summarize

    assert host_load.parse_stat(STAT) == (1500, 9600, 2)
    assert host_load.parse_stat("intr 1\n") is None
    assert host_load.parse_mhz("cpu MHz\t\t: 2000.0\ncpu MHz\t\t: 3000.5\n") == pytest.approx(2500.25)
    assert host_load.parse_mhz("processor : 0\n") is None
    before = {"wall": 10.0, "process_cpu": 4.0, "busy": 1500, "ticks": 9600, "cpus": 16, "mhz": 2450.4}
    after = {"wall": 40.0, "process_cpu": 61.0, "busy": 3500, "ticks": 14600, "cpus": 16, "mhz": 2450.4}
    rec = host_load.host_window(before, after)  # 57 CPU s over 30 s; 2,000 of 5,000 ticks busy on 16 CPUs
    assert rec == {"process_cores": 1.9, "machine_cores": 6.4, "cpus": 16, "mhz": 2450}
    assert host_load.worth_a_line(rec) and "4.5 of 16 CPUs busy" in host_load.format_host(rec)
    alone = host_load.host_window(before, {**after, "busy": 2100})  # 0.6 of a CPU beyond the process: no line
    assert not host_load.worth_a_line(alone) and host_load.others({**alone, "machine_cores": 1.0}) == 0.0
    assert host_load.host_window(None, after) is None and host_load.host_window(after, after) is None
    samples = iter([before, after])
    clock = Clock()
    stats = ProfileStats("main", clock=clock, host=lambda: next(samples))
    with stats.loop("drafter").span("drafter_forward"):
        clock.t += 1.0
    record = attach_verdict(window_record(stats, stats.take_window()))
    assert record["host"] == rec and "host: the rest of the machine" in format_record(record)
    assert "host (over windows): this process 1.9 CPUs (most 1.9), the rest of the machine 4.5" in summarize([record])
    if host_load.STAT.exists():  # Linux: a real window
        now = host_load.snapshot()
        assert now is not None and now["cpus"] >= 1 and now["ticks"] >= now["busy"] > 0


def test_interval_from_env_and_flag_precedence(monkeypatch):
    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    assert resolve_interval(None) is None  # off by default
    monkeypatch.setenv("DFLASH_PROFILE_INTERVAL", "7.5")
    assert resolve_interval(None) == 7.5
    assert resolve_interval(2.0) == 2.0  # the flag wins
    assert resolve_interval(0.0) is None  # --profile-interval 0 turns it off
    monkeypatch.setenv("DFLASH_PROFILE_INTERVAL", "often")
    with pytest.raises(UsageError, match="DFLASH_PROFILE_INTERVAL"):
        resolve_interval(None)
    with pytest.raises(UsageError, match="--profile-interval"):
        resolve_interval(-1.0)


def test_the_no_op_path_records_nothing():
    prof = NULL_PROFILE.loop("drafter")
    with prof.span("drafter_forward", device=True):
        pass
    prof.add("x", 1.0)
    prof.count("tokens", 5)
    prof.gauge("depth", 2)
    assert NULL_PROFILE.enabled is False
    w = NULL_PROFILE.take_window()
    assert not w.durations and not w.counters and not w.gauges


def test_a_muted_view_records_only_the_span_around_it():
    """Validation is timed whole; the objective's and the layers' spans inside it stay out of training's stages."""
    clock = Clock()
    stats = ProfileStats("p", clock=clock)
    prof = stats.loop("drafter")
    _timed(prof, clock, "drafter.masks", 0.02)
    with prof.span("validate"), prof.muted():
        _timed(prof, clock, "drafter.masks", 0.5)
        prof.count("tokens", 99)
    clock.t += 1
    stages = window_record(stats, stats.take_window())["loops"]["drafter"]["stages"]
    assert stages["drafter.masks"]["count"] == 1 and stages["validate"]["count"] == 1
    assert stages["validate"]["mean_ms"] == pytest.approx(500.0)
    with NULL_PROFILE.loop("x").muted():
        pass


def test_format_limits_lines():
    clock = Clock()
    with _collector_off():
        stats = ProfileStats("p", clock=clock)
        prof = stats.loop("drafter")
        for key in ("a", "b", "c"):
            _timed(prof, clock, key, 0.01)
        text = format_record(attach_verdict(window_record(stats, stats.take_window())), limit=2)
    assert text.count("\n") == 4  # header, column line, 2 stages, verdict


def test_torch_profile_window_writes_a_trace(tmp_path):
    from dflash_train.cli import main

    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"answer number {i} " * 4}]})
                            + "\n" for i in range(6)))
    run = tmp_path / "run"
    assert main(["train", "--target", "random:tiny", "--data", str(data), "--no-regenerate", "--num-conversations", "0",
                 "--data-topic", "any", "--max-length", "96", "--token-budget", "192", "--max-steps", "4",
                 "--eval-limit", "0", "--run-dir", str(run), "--quiet", "--torch-profile", "1:3"]) == 0
    (trace,) = (run / "traces").iterdir()
    assert trace.suffix == ".json" and "traceEvents" in trace.read_text()[:2000]
    assert main(["train", "--target", "random:tiny", "--run-dir", str(tmp_path / "x"), "--torch-profile", "3:1"]) == 2


def _trace_steps(tmp_path, window, steps):
    """The ProfilerStep#N markers in the trace a TraceWindow wrote over `steps`; None: no trace."""
    import torch

    from dflash_train.profiling.tools import TraceWindow

    x = torch.ones(8, 8)
    with TraceWindow(*window, tmp_path, "rank0/drafter/cpu") as trace:
        for step in steps:
            trace.at(step)
            trace.at(step)  # a second loop of the process at the same step (the target thread): no extra step
            x = x @ x / 8
    files = list((tmp_path / "traces").glob("*.json")) if (tmp_path / "traces").exists() else []
    if not files:
        return None
    (path,) = files
    assert path.name == "rank0_drafter_cpu.json"
    events = json.loads(path.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})


def test_trace_window_records_the_chosen_steps_on_the_schedule(tmp_path):
    # steps 0..5, window 2:4: waits on 0, warms up on 1, records 2 and 3, writes when step 4 begins
    assert _trace_steps(tmp_path / "a", (2, 4), range(6)) == ["ProfilerStep#2", "ProfilerStep#3"]
    # the run ends inside the window: the steps recorded so far are written at exit
    assert _trace_steps(tmp_path / "b", (1, 9), range(3)) == ["ProfilerStep#1", "ProfilerStep#2"]
    # a resumed run starting inside the window records from its first step (markers count from it)
    assert _trace_steps(tmp_path / "c", (1, 3), range(2, 5)) == ["ProfilerStep#0"]
    # ... and one starting past it writes nothing
    assert _trace_steps(tmp_path / "d", (1, 3), range(5, 7)) is None


def test_memory_history_runs_around_the_oom_snapshot_on_cuda_only(tmp_path, monkeypatch):
    import torch

    from dflash_train.profiling.session import profile_session
    from dflash_train.profiling.tools import oom_snapshot
    from dflash_train.settings.tree import TrainConfig

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls.append((enabled, kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    cfg = TrainConfig.of(memory_history=1000, profile_interval=0)
    with profile_session(cfg.profiling, tmp_path, "main/cpu", cfg.oom_hint()):  # CPU: nothing recorded
        pass
    assert calls == []
    with pytest.raises(UsageError, match="memory snapshot"), \
            oom_snapshot(tmp_path, "main/cuda:0", cfg.oom_hint(), 1000):
        raise torch.cuda.OutOfMemoryError("planted")
    assert calls[0] == ("all", {"max_entries": 1000, "stacks": "python"})  # from the start, with stacks
    assert calls[1] == ("dump", str(tmp_path / "oom-main_cuda_0.pickle"))  # the snapshot carries them
    assert calls[2] == (None, {})  # and recording stops when the process leaves
    with pytest.raises(UsageError, match="--memory-history must be >= 0"):
        TrainConfig.of(memory_history=-1)


# --- three clocks per span, allocator telemetry, launch-/sync-bound and allocator-churn verdicts


class CountingClock(Clock):
    """A mocked clock that also counts its reads (the per-span overhead is a number of clock calls)."""

    def __init__(self, start=100.0):
        super().__init__()
        self.t, self.calls = start, 0

    def __call__(self):
        self.calls += 1
        return self.t


def _clocked(prof, wall, cpu, key, wall_s, cpu_s, **span_args):
    with prof.span(key, **span_args):
        wall.t += wall_s
        cpu.t += cpu_s


def test_span_reads_wall_and_thread_cpu_once_per_edge():
    wall, cpu = CountingClock(), CountingClock(0.0)
    stats = ProfileStats("p", clock=wall, cpu_clock=cpu)
    prof = stats.loop("drafter")
    wall.calls = cpu.calls = 0
    for ms in (3, 1, 2):
        _clocked(prof, wall, cpu, "drafter_forward", ms / 1000, ms / 2000)
    assert (wall.calls, cpu.calls) == (6, 6)  # one perf_counter and one thread_time per span edge
    prof.add("hs_queue_wait", 0.5)  # a wait measured elsewhere carries no clocks
    _clocked(prof, wall, cpu, "metrics", 0.004, 0.0001, sync="loss read-back")
    wall.t += 1
    rec = window_record(stats, stats.take_window())
    fwd, wait, met = (rec["loops"]["drafter"]["stages"][k] for k in ("drafter_forward", "hs_queue_wait", "metrics"))
    assert fwd["min_ms"] == pytest.approx(1.0) and fwd["max_ms"] == pytest.approx(3.0)
    assert fwd["wall_s"] == pytest.approx(0.006) and fwd["cpu_s"] == pytest.approx(0.003)
    assert fwd["host_busy"] == pytest.approx(0.5)
    assert "device_s" not in fwd and "device_busy" not in fwd  # no CUDA events: no device clock
    assert not {"wall_s", "cpu_s", "host_busy"} & set(wait)
    assert met["sync"] == "loss read-back" and met["host_busy"] == pytest.approx(0.025)
    cum = rec["loops"]["drafter"]["cumulative"]["stages"]["drafter_forward"]
    assert cum["wall_s"] == pytest.approx(0.006) and cum["cpu_s"] == pytest.approx(0.003)


class FakeEvent:
    """torch.cuda.Event on a simulated GPU clock: record() stamps the device time; no real device."""

    device_now = 0.0
    synchronized = 0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = FakeEvent.device_now

    def synchronize(self):
        FakeEvent.synchronized += 1

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def test_event_spans_keep_device_time_primary_and_add_wall_and_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.device_now, FakeEvent.synchronized = 0.0, 0
    wall, cpu = CountingClock(), CountingClock(0.0)
    stats = ProfileStats("p", cuda_events=True, clock=wall, cpu_clock=cpu, stream_drained=lambda: False)
    prof = stats.loop("drafter")
    for _ in range(4):  # the host launches for 10 ms; the GPU runs the stage's work for 30 ms
        with prof.span("drafter_forward", device=True):
            wall.t += 0.010
            cpu.t += 0.009
            FakeEvent.device_now += 0.030
    assert FakeEvent.synchronized == 0  # spans never wait for the device
    wall.t += 1
    s = window_record(stats, stats.take_window())["loops"]["drafter"]["stages"]["drafter_forward"]
    assert FakeEvent.synchronized == 4  # resolved when the window is taken (the reporter thread)
    assert s["mean_ms"] == pytest.approx(30.0) and s["total_s"] == pytest.approx(0.12)  # device time, as before
    assert s["wall_s"] == pytest.approx(0.04) and s["cpu_s"] == pytest.approx(0.036)
    assert s["device_s"] == pytest.approx(0.12)
    assert s["host_busy"] == pytest.approx(0.9) and s["device_busy"] == pytest.approx(3.0)
    assert (s["starts"], s["starved"], s["starved_share"]) == (4, 0, 0.0)  # the GPU behind: never found idle


class QueryEvent(FakeEvent):
    """A FakeEvent the simulated GPU has passed once its clock reaches the event's (query())."""

    gpu_at = 0.0  # how far the GPU has got, in simulated device time

    def query(self):
        return self.at <= QueryEvent.gpu_at


def test_device_timer_cpu_path_is_the_wall_clock():
    from dflash_train.profiling.device_time import DeviceTimer

    clock = Clock()
    timer = DeviceTimer(cuda=False, clock=clock)
    start = timer.mark()
    clock.t += 0.25
    timer.add(start, timer.mark(), "a")
    assert timer.ready() == [(pytest.approx(0.25), "a")] and len(timer) == 0  # off CUDA every span is ready at once
    start = timer.mark()
    clock.t += 0.5
    timer.add(start, timer.mark())
    assert timer.ready_seconds() == pytest.approx(0.5)


def test_device_timer_reads_only_the_events_the_gpu_has_passed(monkeypatch):
    import torch

    from dflash_train.profiling.device_time import DeviceTimer

    monkeypatch.setattr(torch.cuda, "Event", QueryEvent)
    FakeEvent.device_now, FakeEvent.synchronized, QueryEvent.gpu_at = 0.0, 0, 0.0
    timer = DeviceTimer(cuda=True)
    for _ in range(3):  # three packs of 20 ms of GPU work each, queued ahead of the GPU
        start = timer.mark()
        FakeEvent.device_now += 0.020
        timer.add(start, timer.mark())
    assert timer.ready_seconds() == 0.0 and len(timer) == 3  # the GPU has passed none: nothing read, no wait
    QueryEvent.gpu_at = 0.045  # two packs done, the third still running
    assert timer.ready_seconds() == pytest.approx(0.040) and len(timer) == 1
    assert FakeEvent.synchronized == 0  # query() only: never a host sync
    batch = timer.detach()  # what a window takes; the timer queues anew
    assert len(timer) == 0 and batch.resolve() == [(pytest.approx(0.020), None)]
    assert FakeEvent.synchronized == 1  # resolve() waits, span by span (a reporter thread's job)


def test_summary_line_shows_min_and_busy_columns():
    wall, cpu = CountingClock(), CountingClock(0.0)
    stats = ProfileStats("p", clock=wall, cpu_clock=cpu)
    prof = stats.loop("drafter")
    for ms in (5, 2, 8):
        _clocked(prof, wall, cpu, "drafter_forward", ms / 1000, ms / 1000 * 0.75)
    prof.add("hs_queue_wait", 0.001)
    text = format_record(attach_verdict(window_record(stats, stats.take_window())))
    head = next(line for line in text.splitlines() if "stage" in line).split()
    assert head[head.index("count"):] == ["count", "mean", "ms", "p50", "ms", "min", "ms", "p95", "ms", "max", "ms",
                                          "total", "s", "share", "host", "dev", "starved"]
    fwd = next(line for line in text.splitlines() if "drafter_forward" in line).split()
    # count, mean, p50, min, p95, max, total, share, host, dev, starved
    assert fwd[1:6] == ["3", "5.00", "5.00", "2.00", "7.70"] and fwd[6] == "8.00"
    assert fwd[-3:] == ["75%", "-", "-"]  # no CUDA events: the device and starved columns stay empty
    wait = next(line for line in text.splitlines() if "hs_queue_wait" in line).split()
    assert wait[-3:] == ["-", "-", "-"]


def _stage(wall, cpu, device=None, sync=None, share=None):
    s = {"wall_s": wall, "cpu_s": cpu, "share": wall / 10 if share is None else share}
    if device is not None:
        s["device_s"] = device
    if sync is not None:
        s["sync"] = sync
    return s


def _clock_record(allocator=None, **stages):
    """A 10 s drafter-loop record from stage clocks; keys as in _record ('loop__stage')."""
    loops = {}
    for key, s in stages.items():
        loop, stage = key.split("__")
        loops.setdefault(loop, {"stages": {}})["stages"][stage] = s
    record = {"window_s": 10.0, "loops": loops}
    if allocator is not None:
        record["allocator"] = allocator
    return record


LAUNCH = {"drafter__drafter_forward": _stage(4.0, 3.8, 4.0), "drafter__backward": _stage(3.0, 2.9, 3.05),
          "drafter__drafter.L0.mlp": _stage(1.0, 0.95, 1.0)}


@pytest.mark.parametrize("stages, kind, says", [
    # on-CPU ~95% of the GPU stages' wall and the GPU keeps pace: the host's launches are the limit
    (LAUNCH, "launch-bound", "on-CPU 96%"),
    # the same loop on CPU (no device clock): no launch claim
    ({k: {n: v for n, v in s.items() if n != "device_s"} for k, s in LAUNCH.items()}, "balanced", ""),
    # the GPU runs 5 s behind the host and the metrics read-back waits for it: compute, not sync or launch
    ({"drafter__drafter_forward": _stage(1.0, 1.0, 6.0), "drafter__metrics": _stage(5.0, 0.1, sync="loss .item()")},
     "balanced", ""),
    # a declared sync blocks 50% while the GPU keeps pace: sync-bound, named
    ({"drafter__drafter_forward": _stage(2.0, 1.9, 2.0), "drafter__metrics": _stage(5.0, 0.1, sync="loss .item()")},
     "sync-bound", "drafter metrics is blocked 50% of the window"),
    # CUDA spin-waits in a sync (CPU ~ wall): a declared sync is judged on wall vs device
    ({"drafter__drafter_forward": _stage(2.0, 1.9, 2.0), "drafter__metrics": _stage(5.0, 4.9, sync="loss .item()")},
     "sync-bound", "at loss .item()"),
    # the same spinning span without a declared sync is indistinguishable from host work
    ({"drafter__drafter_forward": _stage(2.0, 1.9, 2.0), "drafter__metrics": _stage(5.0, 4.9)}, "balanced", ""),
    # an unnamed block inside a nested stage: the nested stage is named, not its parent
    ({"drafter__drafter_forward": _stage(4.0, 1.1, 1.3), "drafter__drafter.lm_head_loss": _stage(3.0, 0.2, 0.3)},
     "sync-bound", "drafter drafter.lm_head_loss is blocked 27%"),
    # a role verdict (drafters wait on an empty hs_queue) still comes first
    ({**LAUNCH, "drafter__hs_queue_wait": {"share": 0.3}}, "target-bound", ""),
])
def test_clock_verdicts_from_synthetic_stages(stages, kind, says):
    v = verdict(_clock_record(**stages))
    assert v.kind == kind, v.message
    assert v.message.startswith(kind) and says in v.message


def test_clock_verdict_messages_carry_the_advice():
    assert "CUDA graphs" in verdict(_clock_record(**LAUNCH)).message
    sync = {"drafter__drafter_forward": _stage(2.0, 1.9, 2.0), "drafter__metrics": _stage(5.0, 0.1)}
    assert "unnamed host sync" in verdict(_clock_record(**sync)).message


def _snapshot(allocs, frees, retries=0, reserved=8 << 30, allocated=6 << 30):
    return {"num_device_alloc": allocs, "num_device_free": frees, "num_alloc_retries": retries,
            "num_sync_all_streams": retries, "num_ooms": 0,
            "reserved_bytes.all.current": reserved, "allocated_bytes.all.current": allocated}


def test_allocator_window_math_tolerates_missing_keys_and_resets():
    from dflash_train.profiling.allocator import allocator_window

    rec = allocator_window(_snapshot(10, 2, 1), _snapshot(14, 5, 1), index=3)
    assert rec == {"window": 3, "alloc_retries": 0, "device_allocs": 4, "device_frees": 3, "sync_all_streams": 0,
                   "ooms": 0, "reserved_bytes": 8 << 30, "allocated_bytes": 6 << 30}
    assert allocator_window({}, {"num_device_alloc": 7}, 0) == {"window": 0, "device_allocs": 7}  # older torch
    assert allocator_window({"num_device_free": 9}, {"num_device_free": 2}, 1)["device_frees"] == 0  # stats reset


@pytest.mark.parametrize("window, allocs, frees, retries, kind", [
    (2, 3, 3, 0, "allocator-churn"),  # steady state, frees and mallocs: churn
    (2, 0, 0, 1, "allocator-churn"),  # a retried malloc (cache flushed) in steady state
    (1, 3, 3, 1, "balanced"),  # warm-up window: the pool is still growing to the run's shapes
    (2, 2, 0, 0, "balanced"),  # growth only (a new longest pack) is not churn
])
def test_allocator_churn_verdict(window, allocs, frees, retries, kind):
    alloc = {"window": window, "device_allocs": allocs, "device_frees": frees, "alloc_retries": retries}
    v = verdict(_clock_record(allocator=alloc, drafter__backward=_stage(2.0, 1.9)))
    assert v.kind == kind
    if kind == "allocator-churn":
        assert f"{allocs} mallocs/maps, {frees} frees/unmaps, {retries} retries" in v.message
        assert "expandable_segments" in v.message


CHURN = {"window": 4, "device_allocs": 12, "device_frees": 12, "alloc_retries": 0}  # steady state, cycling


def test_churn_while_the_drafter_limits_is_a_qualifier_of_the_role_verdict():
    """The target waits on a full queue (drafter-bound) and the allocator churns: the role verdict
    comes first and carries the churn in brackets, with its counts and advice; the record lists it."""
    rec = attach_verdict(_clock_record(allocator=CHURN, target__hs_queue_full_wait={"share": 0.33},
                                       drafter__backward=_stage(2.0, 1.9)))
    v = rec["verdict"]
    assert v["kind"] == "drafter-bound"
    assert v["message"].startswith("drafter-bound (allocator-churn: after warm-up the CUDA allocator still cycles "
                                   "memory (this window: 12 mallocs/maps, 12 frees/unmaps, 0 retries")
    assert "expandable_segments" in v["message"]
    assert "): target workers wait 33% on a full hs_queue — add drafter devices" in v["message"]
    assert v["also"] == ["allocator-churn"]
    # without churn: no brackets, no `also`
    plain = attach_verdict(_clock_record(target__hs_queue_full_wait={"share": 0.33}))["verdict"]
    assert plain["message"].startswith("drafter-bound: target workers") and "also" not in plain


def test_churn_and_a_launch_bound_role_share_the_brackets():
    v = verdict(_clock_record(allocator=CHURN, **STARVED_TARGET, drafter__hs_queue_wait={"share": 0.3},
                              drafter__backward=_ev(1.0, 0.9, 1.0, 100, 0)))
    assert v.kind == "launch-bound" and v.also == ("target-bound", "allocator-churn")
    assert v.message.startswith("launch-bound (target-bound: drafters wait 30% on an empty hs_queue; "
                                "allocator-churn: after warm-up")
    assert "): target GPU spans found the stream drained" in v.message


def test_sync_bound_beside_churn_and_beside_a_role():
    sync = {"drafter__drafter_forward": _stage(2.0, 1.9, 2.0),
            "drafter__metrics": _stage(5.0, 0.1, sync="loss .item()")}
    v = verdict(_clock_record(allocator=CHURN, **sync))
    assert v.kind == "allocator-churn" and v.also == ("sync-bound",)
    assert v.message.startswith("allocator-churn (sync-bound: drafter metrics is blocked 50% of the window")
    v = verdict(_clock_record(**sync, target__hs_queue_full_wait={"share": 0.3}))
    assert v.kind == "drafter-bound" and v.also == ("sync-bound",)


def test_churn_plant_through_profile_stats_while_the_drafter_limits():
    """The churn plant's pattern (a buffer of a new size each step, freed, the cache emptied: a malloc
    and a free per step) in the allocator counters of a run whose target waits on a full queue."""
    steps = iter(range(100))

    def memory_stats():  # cumulative counters as torch.cuda.memory_stats() reports them
        n = next(steps)
        return _snapshot(allocs=10 + 3 * n, frees=3 * n)

    clock = Clock()
    stats = ProfileStats("main/cuda:0", clock=clock, memory_stats=memory_stats)
    target, drafter = stats.loop("target"), stats.loop("drafter")
    kinds = []
    for _ in range(5):
        _timed(drafter, clock, "backward", 1.0)
        target.add("hs_queue_full_wait", 4.0)
        clock.t += 9.0
        rec = attach_verdict(window_record(stats, stats.take_window()))
        kinds.append((rec["verdict"]["kind"], tuple(rec["verdict"].get("also", ()))))
    assert "verdict: drafter-bound (allocator-churn: " in format_record(rec)  # the summary's verdict line
    # the first windows are the allocator's warm-up; after them every window churns while the drafter limits
    assert kinds[-2:] == [("drafter-bound", ("allocator-churn",))] * 2
    assert all(k == ("drafter-bound", ()) for k in kinds[:2]), kinds


def test_profile_report_shows_the_churn_beside_the_role_verdict():
    """profile-report's verdict history of a drafter-bound run that churns names the churn."""
    from dflash_train.profiling.report import summarize

    records = []
    for i in range(5):
        rec = _clock_record(allocator={**CHURN, "window": i}, target__hs_queue_full_wait={"share": 0.33},
                            drafter__backward=_stage(2.0, 1.9))
        rec.update(type="profile", process="main/cuda:0", elapsed_s=10.0 * (i + 1))
        records.append(attach_verdict(rec))
    text = summarize(records)
    # the warm-up windows come without the qualifier, the steady ones with it: two lines, the churn kept visible
    assert "drafter-bound (x2 windows): drafter-bound: target workers" in text, text
    assert "drafter-bound (x3 windows): drafter-bound (allocator-churn: after warm-up" in text, text


def test_allocator_telemetry_per_window_through_profile_stats():
    snapshots = iter([{}, _snapshot(5, 0), _snapshot(9, 0), _snapshot(12, 3, 1)])  # {}: CUDA not started yet
    clock = Clock()
    stats = ProfileStats("rank1/drafter/cuda:1", clock=clock, memory_stats=lambda: next(snapshots))
    prof = stats.loop("drafter")
    records = []
    for _ in range(4):
        _timed(prof, clock, "backward", 1.0)
        clock.t += 9.0
        records.append(attach_verdict(window_record(stats, stats.take_window())))
    assert "allocator" not in records[0]
    assert [r["allocator"]["window"] for r in records[1:]] == [0, 1, 2]
    assert [r["allocator"]["device_allocs"] for r in records[1:]] == [5, 4, 3]
    assert [r["verdict"]["kind"] for r in records] == ["balanced", "balanced", "balanced", "allocator-churn"]
    text = format_record(records[3])
    assert "allocator: reserved 8.00 GiB, allocated 6.00 GiB | alloc_retries +1, device_allocs +3" in text
    assert NULL_PROFILE.take_window().allocator is None


def test_memory_stats_source_only_for_cuda_processes(monkeypatch):
    import torch

    from dflash_train.profiling.session import memory_stats_source

    assert memory_stats_source("rank0/target/cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: seen.append(device) or {})
    memory_stats_source("rank1/drafter/cuda:1")()
    assert seen == [torch.device("cuda:1")]


def test_a_profiled_run_times_the_drafter_internals(tiny_target, make_drafter, in_memory_dataset, tmp_path):
    """The drafter's breakdown (fusion, each layer's attention and MLP; the objective's masks and LM head + loss)
    sits inside drafter_forward, once per micro-batch."""
    import numpy as np

    from dflash_train.app.local import train_local
    from dflash_train.settings.tree import TrainConfig

    cfg = TrainConfig.of(run_dir=str(tmp_path), target="random:tiny", max_length=48, token_budget=96, block_size=4,
                      num_layers=2, max_steps=2, grad_accum=2, log_every=1, checkpoint_every=0, overlap=False)
    pairs = [(np.arange(3, 43), np.array([0] * 4 + [1] * 36)) for _ in range(4)]
    stats = ProfileStats("test")
    train_local(cfg, tiny_target, make_drafter(num_layers=2, block_size=4).train(), in_memory_dataset(pairs), tmp_path,
                progress=False, stats=stats, checkpoints=False)
    stages = window_record(stats, stats.take_window())["loops"]["drafter"]["stages"]
    internals = ["drafter.masks", "drafter.fc", "drafter.L0.attention", "drafter.L0.mlp", "drafter.L1.attention",
                 "drafter.L1.mlp", "drafter.lm_head_loss"]
    assert all(stages[k]["count"] == 4 for k in ["drafter_forward", *internals])
    assert sum(stages[k]["total_s"] for k in internals) <= stages["drafter_forward"]["total_s"]


@pytest.mark.parametrize("stack", [False, True])
def test_compiled_layers_are_timed_whole(make_drafter, stack):
    """--compile-drafter: a hook inside a compiled layer would break its graph, so each layer is one span (with
    --compile-stack, the layers one span together)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from dflash_train.profiling.hooks import drafter_spans

    drafter = make_drafter(num_layers=2, block_size=4)
    stats = ProfileStats("test")
    prof = stats.loop("drafter")
    torch._dynamo.reset()
    counters.clear()
    compiled = [drafter.layers] if stack else list(drafter.layers)
    with drafter.compiled_layers(backend="eager", stack=stack), torch.no_grad(), \
            drafter_spans(drafter, prof, whole_layers=True, whole_stack=stack):
        assert all("forward" in vars(m) for m in compiled)  # compiled
        drafter(torch.randn(1, 4, 64), torch.randn(1, 6, 3 * 64), torch.arange(10)[None])
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]  # the spans stayed outside
    stages = window_record(stats, stats.take_window())["loops"]["drafter"]["stages"]
    spans = ["drafter.layers"] if stack else ["drafter.L0", "drafter.L1"]
    assert {k for k in stages if k.startswith("drafter.")} == {"drafter.fc", *spans}
    assert all(stages[k]["count"] == 1 for k in spans)
    assert all("forward" not in vars(m) for m in compiled)  # eager again


# --- does each event span start find its stream drained (the GPU waiting for the host)?


class SimStream:
    """One CUDA stream on a simulated GPU sharing the host's wall clock: launches queue kernels that
    run in order; query() (the injected stream_drained) is True once every queued kernel has run;
    event() stands in for torch.cuda.Event on this stream."""

    def __init__(self, wall):
        self.wall, self.busy_until, self.queries, self.event_syncs = wall, wall.t, 0, 0

    def launch(self, host_s, kernel_s):
        self.busy_until = max(self.busy_until, self.wall.t) + kernel_s  # queue a kernel of kernel_s,
        self.wall.t += host_s  # then the host spends host_s (launch overhead, Python) before the next

    def synchronize(self):  # a host sync (.item()): the host waits until the stream drains
        self.wall.t = max(self.wall.t, self.busy_until)

    def query(self):
        self.queries += 1
        return self.busy_until <= self.wall.t

    def event(self, enable_timing=False):
        return SimEvent(self)


class SimEvent:
    """A timing event on a SimStream: the GPU reaches it once the work queued before it has run."""

    def __init__(self, stream):
        self.stream, self.at = stream, None

    def record(self):
        s = self.stream
        self.at = s.busy_until = max(s.busy_until, s.wall.t)  # an event takes no GPU time

    def synchronize(self):
        self.stream.event_syncs += 1

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def _sim_step(prof, stream, launch_s, kernel_s, sync):
    """One training step's spans: a forward with a nested layer, backward, optimizer; then maybe a read-back."""
    with prof.span("drafter_forward", device=True):
        stream.launch(launch_s, kernel_s)
        with prof.span("drafter.L0.attention", device=True):
            stream.launch(launch_s, kernel_s)
    with prof.span("backward", device=True):
        stream.launch(launch_s, kernel_s)
    with prof.span("optimizer_step", device=True):
        stream.launch(launch_s, kernel_s)
    if sync:
        with prof.span("metrics", sync="loss .item()"):  # a host span: no event, no query
            stream.synchronize()


def _sim_stats(monkeypatch, cuda_events=True):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    wall = CountingClock()
    stream = SimStream(wall)
    monkeypatch.setattr(torch.cuda, "Event", stream.event)
    stats = ProfileStats("p", cuda_events=cuda_events, clock=wall, cpu_clock=CountingClock(0.0),
                         stream_drained=stream.query)
    return stats, stream, wall


GPU_STAGES = ("drafter_forward", "drafter.L0.attention", "backward", "optimizer_step")


def test_launch_bound_spans_start_on_a_drained_stream(monkeypatch):
    stats, stream, wall = _sim_stats(monkeypatch)
    prof = stats.loop("drafter")
    for _ in range(5):  # 1 ms to launch each 0.2 ms kernel: the GPU idles before every launch
        _sim_step(prof, stream, 0.001, 0.0002, sync=False)
    assert stream.queries == 4 * 5  # one query per event-span start, nested spans included
    assert stream.event_syncs == 0  # and no host sync in the loop
    wall.t += 1
    stages = window_record(stats, stats.take_window())["loops"]["drafter"]["stages"]
    for name in GPU_STAGES:
        assert (stages[name]["starts"], stages[name]["starved"]) == (5, 5), name
        assert stages[name]["starved_share"] == 1.0


def test_a_per_step_sync_drains_the_stream_once_per_step(monkeypatch):
    stats, stream, wall = _sim_stats(monkeypatch)
    prof = stats.loop("drafter")
    for _ in range(6):  # 0.1 ms launches of 5 ms kernels, then the step's .item(): the GPU is the limit
        _sim_step(prof, stream, 0.0001, 0.005, sync=True)
    assert stream.queries == 4 * 6  # the host-only metrics span asks nothing
    wall.t += 1
    rec = window_record(stats, stats.take_window())
    stages = rec["loops"]["drafter"]["stages"]
    # Only the step's first span starts after the sync; the others find the previous kernels queued.
    assert (stages["drafter_forward"]["starts"], stages["drafter_forward"]["starved"]) == (6, 6)
    for name in GPU_STAGES[1:]:
        assert (stages[name]["starts"], stages[name]["starved"]) == (6, 0), name
        assert stages[name]["starved_share"] == 0.0
    assert not {"starts", "starved", "starved_share"} & set(stages["metrics"])  # a host span: no stream asked
    # Windows sum into the cumulative totals (counts, so the report can pool them).
    _sim_step(prof, stream, 0.0001, 0.005, sync=True)
    wall.t += 1
    cum = window_record(stats, stats.take_window())["loops"]["drafter"]["cumulative"]["stages"]
    assert (cum["drafter_forward"]["starts"], cum["drafter_forward"]["starved"]) == (7, 7)
    assert (cum["backward"]["starts"], cum["backward"]["starved"]) == (7, 0)
    assert "starved_share" not in cum["backward"]


def test_wall_mode_never_asks_the_stream(monkeypatch):
    stats, stream, wall = _sim_stats(monkeypatch, cuda_events=False)
    prof = stats.loop("drafter")
    _sim_step(prof, stream, 0.001, 0.0002, sync=False)
    assert stream.queries == 0
    wall.t += 1
    rec = window_record(stats, stats.take_window())
    for s in (*rec["loops"]["drafter"]["stages"].values(), *rec["loops"]["drafter"]["cumulative"]["stages"].values()):
        assert not {"starts", "starved", "starved_share", "device_s"} & set(s)


def test_summary_shows_the_starved_share_per_stage(monkeypatch):
    stats, stream, wall = _sim_stats(monkeypatch)
    prof = stats.loop("drafter")
    for sync in (True, False, False, False):  # backward starts drained after the no-sync steps' idle GPU
        _sim_step(prof, stream, 0.001, 0.0002 if not sync else 0.005, sync=sync)
    prof.add("hs_queue_wait", 0.001)
    wall.t += 1
    lines = format_record(window_record(stats, stats.take_window())).splitlines()
    assert next(line for line in lines if "stage" in line).split()[-1] == "starved"
    row = {line.split()[0]: line.split() for line in lines[2:] if line.split()}
    assert row["drafter_forward"][-1] == "100%"
    assert row["backward"][-1] == "75%"  # 3 of 4: the first step's 5 ms kernels were still queued
    assert row["metrics"][-1] == "-" and row["hs_queue_wait"][-1] == "-"


def _ev(wall, cpu, device, starts, starved):
    """A CUDA-event stage whose spans started `starts` times, `starved` of them on a drained stream."""
    return {**_stage(wall, cpu, device), "starts": starts, "starved": starved}


# The drafter of the GIL-sharing pipeline: its thread on-CPU 35% of its GPU stages' wall (below HOST_BUSY),
# the GPU keeping pace, most span starts (nested ones too) finding the stream drained: 245 of 300.
STARVED_DRAFTER = {"drafter__drafter_forward": _ev(5.0, 1.75, 5.0, 100, 90),
                   "drafter__drafter.L0.attention": _ev(2.0, 0.7, 2.0, 100, 85),
                   "drafter__backward": _ev(4.0, 1.4, 4.05, 100, 70)}
# Its target thread in the same process, on-CPU 55%: together the loops hold the host 81% of the window.
STARVED_TARGET = {"target__target_forward": _ev(6.0, 3.3, 6.0, 100, 100),
                  "target__pack_hidden": _ev(3.0, 1.65, 3.0, 100, 100)}
# One host sync per step (GPU-bound): only the step's first span and the one nested at its start begin idle.
PER_STEP_SYNC = {f"drafter__{name}": _ev(wall, wall * 0.35, wall, 100, 100 if first else 0)
                 for name, wall, first in (("drafter_forward", 4.0, True), ("drafter.masks", 0.5, True),
                                           ("drafter.fc", 0.3, False), ("drafter.L0.attention", 1.0, False),
                                           ("drafter.L0.mlp", 1.0, False), ("drafter.lm_head_loss", 1.0, False),
                                           ("backward", 3.0, False), ("optimizer_step", 1.0, False))}


@pytest.mark.parametrize("stages, kind, says", [
    # the GPU waits for the host at 82% of span starts: launch-bound although the thread is on-CPU 35% only,
    # and with the target loop the process's host is busy: the loops contend for the GIL
    ({**STARVED_DRAFTER, **STARVED_TARGET}, "launch-bound",
     "drafter GPU spans found the stream drained (the GPU idle, waiting for the host) at 82% of 300 starts; "
     "its thread is on-CPU 35% of its GPU stages' wall time; the process's loops are on-CPU 81% of the window "
     "together: they contend for the GIL/host"),
    # the drafter alone: launch-bound, and no GIL contention claimed (the process's host 32% busy)
    (STARVED_DRAFTER, "launch-bound", "at 82% of 300 starts; its thread is on-CPU 35% of its GPU stages' wall time —"),
    # the same low CPU share with few drained starts (30 of 300): not launch-bound
    ({k: {**s, "starved": 10} for k, s in STARVED_DRAFTER.items()}, "balanced", ""),
    # a per-step sync drains the stream once a step: 200 of 800 starts, not launch-bound
    (PER_STEP_SYNC, "balanced", ""),
    # STARVED is a share of starts, at or above it: 150 of 300 is launch-bound, 149 is not
    ({k: {**s, "starved": n} for (k, s), n in zip(STARVED_DRAFTER.items(), (50, 50, 50), strict=True)}, "launch-bound",
     "at 50% of 300"),
    ({k: {**s, "starved": n} for (k, s), n in zip(STARVED_DRAFTER.items(), (50, 50, 49), strict=True)}, "balanced", ""),
    # a GPU-bound target of two spans per step whose pageable input copy drains the stream before each
    # pack: half its starts begin idle, but its GPU runs 3 s behind the host: not launch-bound
    ({"target__target_forward": _ev(3.0, 2.7, 6.0, 100, 100), "target__pack_hidden": _ev(0.5, 0.4, 0.6, 100, 0),
      "target__batch_queue_wait": {"share": 0.1}}, "balanced", ""),
    # a role verdict still comes first; a launch-bound drafter does not explain a target-bound window...
    ({**STARVED_DRAFTER, "drafter__hs_queue_wait": {"share": 0.3}}, "target-bound", ""),
    # ...but when the loop it names is itself launch-bound, the verdict is that, with the role in brackets
    ({**STARVED_TARGET, "drafter__hs_queue_wait": {"share": 0.3}, "drafter__backward": _ev(1.0, 0.9, 1.0, 100, 0)},
     "launch-bound", "launch-bound (target-bound: drafters wait 30% on an empty hs_queue): target GPU spans found "
     "the stream drained (the GPU idle, waiting for the host) at 100%"),
])
def test_starved_stream_verdicts(stages, kind, says):
    v = verdict(_clock_record(**stages))
    assert v.kind == kind, v.message
    assert v.message.startswith(kind) and says in v.message
    if kind == "target-bound" and not says:
        assert "launch-bound" not in v.message  # the drafter's launches do not explain a target-bound window
    if kind == "launch-bound":
        assert "CUDA graphs" in v.message
        if "contend" not in says:
            assert "GIL" not in v.message


def test_starved_verdict_from_simulated_runs(monkeypatch):
    """ProfileStats -> record -> verdict on the simulated stream; the thread's CPU clock never moves (0%)."""
    stats, stream, wall = _sim_stats(monkeypatch)
    prof = stats.loop("drafter")
    for _ in range(20):  # 1 ms of host per 0.2 ms kernel: the GPU idles at every span start
        _sim_step(prof, stream, 0.001, 0.0002, sync=False)
    wall.t += 0.02  # the loop's GPU stages fill most of the window
    rec = window_record(stats, stats.take_window())
    assert verdict(rec).kind == "launch-bound", verdict(rec).message
    for _ in range(20):  # 0.1 ms of host per 5 ms kernel and a read-back per step: the GPU is the limit
        _sim_step(prof, stream, 0.0001, 0.005, sync=True)
    rec = window_record(stats, stats.take_window())
    assert verdict(rec).kind != "launch-bound", verdict(rec).message
