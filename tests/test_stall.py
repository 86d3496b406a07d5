"""StallWatch: a run that stops stepping leaves every thread's stack in the run directory."""

import threading
import time

from dflash_train.profiling.stall import StallWatch


def _stuck_in_a_queue_wait(release: threading.Event) -> None:
    release.wait()


def test_a_stall_dumps_every_threads_stack_once(tmp_path, capsys):
    path = tmp_path / "stall-stacks.txt"
    release = threading.Event()
    other = threading.Thread(target=_stuck_in_a_queue_wait, args=(release,), daemon=True)
    other.start()
    with StallWatch(path, 0.4) as watch:
        watch.beat(7)
        time.sleep(1.5)  # several watch periods past the limit: still one dump
        text = path.read_text()
        assert text.count("Timeout (") == 1 and text.count("=== ") == 1 and "after step 7" in text
        assert "_stuck_in_a_queue_wait" in text  # the other thread's stack, not only the watcher's
        watch.beat(8)  # progress re-arms it
        time.sleep(1.0)
    release.set()
    text = path.read_text()
    assert text.count("Timeout (") == 2 and text.count("=== ") == 2 and "after step 8" in text
    assert "every thread's stack is in" in capsys.readouterr().err


def test_steady_beats_never_dump(tmp_path):
    path = tmp_path / "stall-stacks.txt"
    with StallWatch(path, 0.4) as watch:
        for step in range(12):
            watch.beat(step)
            time.sleep(0.1)
    assert not path.exists()


def test_zero_seconds_is_off(tmp_path):
    with StallWatch(tmp_path / "s.txt", 0) as watch:
        assert watch._thread is None and watch._file is None
    assert not (tmp_path / "s.txt").exists()
