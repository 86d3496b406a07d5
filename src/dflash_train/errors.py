"""What the user reads: errors (one line that names the flag, field or file, exit code 2) and
progress lines on stderr."""

import sys


class UsageError(Exception):
    """Bad input from the user. The CLI prints `dflash-train: error: <msg>` and exits 2."""

    exit_code = 2


def say(msg: str) -> None:
    """One progress line on stderr (stdout stays free for a command's output), flushed at once so
    it interleaves in order with the lines of worker processes."""
    print(f"[dflash-train] {msg}", file=sys.stderr, flush=True)
