"""What the user reads: errors (one line that names the flag, field or file, exit code 2) and
progress lines on stderr."""

import sys

from tqdm import tqdm


class UsageError(Exception):
    """Bad input from the user. The CLI prints `dflash-train: error: <msg>` and exits 2."""

    exit_code = 2


def say(msg: str) -> None:
    """One progress line on stderr (stdout stays free for a command's output), flushed at once so
    it interleaves in order with the lines of worker processes. While a progress bar is drawn it goes
    through tqdm, which clears the bar, writes the line and redraws the bar under it: printed plainly,
    the line would continue the bar's."""
    line = f"[dflash-train] {msg}"
    if getattr(tqdm, "_instances", None):  # a bar of this process is open
        tqdm.write(line, file=sys.stderr)
        sys.stderr.flush()
    else:
        print(line, file=sys.stderr, flush=True)
