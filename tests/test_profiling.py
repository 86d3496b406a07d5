"""ProfileStats, summaries, verdicts, the interval setting and the no-op path."""

import json

import pytest

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


def test_jsonl_schema_and_log_lines(tmp_path):
    clock = Clock()
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
        "count", "mean_ms", "p50_ms", "p95_ms", "max_ms", "total_s", "share"}
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
    ({"target__hs_queue_full_wait": 0.41, "target__target_forward": 0.5, "drafter__drafter_forward": 0.9}, "drafter-bound"),
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


def test_format_limits_lines():
    clock = Clock()
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
