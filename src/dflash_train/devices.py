"""Device selection and free device memory, shared by every command."""

from __future__ import annotations

import contextlib
import os

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


def triton_runs_on(device: torch.device) -> bool:
    """Whether this project's Triton kernels can run for tensors on `device`: CUDA, or the CPU under triton's
    interpreter (TRITON_INTERPRET=1: how the tests check them without a GPU; slow). Whether triton is
    installed, and which dtypes a kernel takes, are each kernel's own to say."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def triton_device(device: torch.device):
    """The context a Triton kernel launches in for tensors on `device`: CUDA's device made current (triton
    launches on the current one, which need not be the tensors'), nothing on the CPU (the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can have now: CUDA's free memory, or the host's MemAvailable
    (what the kernel can hand out without swapping or killing); None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:  # no /proc (macOS): free pages, which undercounts what reclaimable caches could give
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(nbytes: int, device: torch.device, what: str) -> None:
    """A UsageError, before the allocation, when `what` (its nbytes) would not fit `device`'s free memory."""
    free = available_memory(device)
    if free is not None and nbytes > free:
        raise UsageError(f"{what} needs {nbytes / 1e9:.1f} GB on {device}, more than the {free / 1e9:.1f} GB "
                         "available there")
