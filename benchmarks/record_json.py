"""A benchmark's figures written to its --json file (atomically: a killed run leaves the old record or none)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflash_train.files import write_atomic  # noqa: E402


def write_json(path: str | None, figures: dict) -> None:
    """figures as indented JSON at `path`; nothing when no path was asked for."""
    if path:
        write_atomic(Path(path), lambda f: f.write(json.dumps(figures, indent=1).encode()))
