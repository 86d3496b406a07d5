"""Device selection shared by every command."""

from __future__ import annotations

import torch

from dflash_train.errors import UsageError


def resolve_device(name: str, flag: str = "--device") -> torch.device:
    """`auto` picks CUDA when present; an unavailable CUDA device is a usage error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"{flag}: unknown device {name!r} (cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{flag} {name}: CUDA is not available on this machine")
    return device
