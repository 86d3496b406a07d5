"""User-facing errors: one line that names the flag, field or file, exit code 2."""


class UsageError(Exception):
    """Bad input from the user. The CLI prints `dflash-train: error: <msg>` and exits 2."""

    exit_code = 2
