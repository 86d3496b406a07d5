"""Drafter checkpoints in the reference (z-lab) HF layout: `config.json` + `model.safetensors`
(+ `modeling_dflash.py`, which `config.json`'s auto_map names for AutoModel with trust_remote_code).

The reference `DFlashDraftModel` (PyPI `dflash`), SGLang and vLLM load what we write with
no missing or unexpected keys; we load theirs. Writes are atomic: a directory is filled
under a temporary name and renamed into place, so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash_train.errors import UsageError
from dflash_train.files import AtomicDirectory
from dflash_train.models.config import DFlashConfig
from dflash_train.models.drafter import DFlashDrafter, RotaryEmbedding

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# A standalone implementation of the drafter for AutoModel.from_pretrained(dir, trust_remote_code=True).
MODELING_NAME = "modeling_dflash.py"
_MODELING_SOURCE = Path(__file__).with_name(MODELING_NAME)
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str, flag: str = "--dtype") -> torch.dtype:
    if name not in _DTYPES:
        raise UsageError(f"{flag}: unknown dtype {name!r} (choose from {', '.join(_DTYPES)})")
    return _DTYPES[name]


def drafter_state_dict(model: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Reference parameter names -> contiguous CPU tensors (buffers such as RoPE excluded); fc's weight with a
    training feature scale folded in (DFlashDrafter.set_feature_scale)."""
    state = {name: p.detach() for name, p in model.named_parameters()}
    state["fc.weight"] = model.exported_fc_weight()
    return {name: t.to("cpu", dtype).contiguous() for name, t in state.items()}


def save_drafter(model: DFlashDrafter, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                 flag: str | None = None) -> Path:
    """Write `out_dir/config.json` and `out_dir/model.safetensors` atomically.

    An old drafter (or an empty directory) at `out_dir` is replaced; anything else there is
    refused (UsageError naming `flag`), so a mistyped path never deletes a user's files.
    Non-finite weights are refused too: such a drafter is useless and would hide a divergence.
    A failed write (a full disk) is a UsageError too, and leaves what was at `out_dir` as it was.
    """
    out = Path(out_dir)
    where = f"{flag} {out}" if flag else str(out)
    check_replaceable(out, flag)
    cfg, state = _drafter_files(model, dtype, where)
    try:
        staged = AtomicDirectory(out)  # check_replaceable above decided that an existing `out` may go
    except OSError as e:
        raise UsageError(f"{where}: cannot create it ({e.strerror or e})") from None
    try:
        with staged as tmp:
            _write_drafter_files(tmp, cfg, state)
    except OSError as e:
        raise UsageError(f"{where}: cannot write it ({e.strerror or e})") from None
    return out


def write_drafter(model: DFlashDrafter, out_dir: Path, dtype: torch.dtype) -> None:
    """The drafter's files into the new directory `out_dir`, for a caller that makes the whole write
    atomic itself (a training checkpoint); a failed write raises OSError."""
    cfg, state = _drafter_files(model, dtype, str(out_dir))
    out_dir.mkdir()
    _write_drafter_files(out_dir, cfg, state)


def _drafter_files(model: DFlashDrafter, dtype: torch.dtype | None, where: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json's content and the weights in `dtype`; UsageError when a weight is not finite."""
    dtype = dtype or next(model.parameters()).dtype
    dtype_name = next(k for k, v in _DTYPES.items() if v == dtype)
    cfg = model.config.to_reference_dict() | {"torch_dtype": dtype_name, "auto_map": AUTO_MAP}
    state = drafter_state_dict(model, dtype)
    bad = next((name for name, t in state.items() if not torch.isfinite(t).all()), None)
    if bad is not None:
        raise UsageError(f"{where}: not written: the drafter's weights are not finite ({bad}, in {dtype_name})")
    return cfg, state


def _write_drafter_files(out: Path, cfg: dict, state: dict[str, torch.Tensor]) -> None:
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    save_weights(state, out / WEIGHTS_NAME)
    shutil.copyfile(_MODELING_SOURCE, out / MODELING_NAME)


# safetensors reports a failed write as a SafetensorError, not an OSError: "... I/O error: No space
# left on device (os error 28)". The errno in it makes it the OSError it is, so callers handle one kind.
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file; its I/O failures raised as OSError naming `path`. `path` must be new: save_file
    writes a temporary file beside it and renames it over `path`."""
    try:
        save_file(state, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        found = _OS_ERROR.search(str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def check_replaceable(out: Path, flag: str | None = None) -> None:
    """UsageError unless `out` is absent, an empty directory or a drafter directory (ours to replace)."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    where = f"{flag} {out}" if flag else str(out)
    if out.is_symlink() or not out.is_dir():
        kind = "a symbolic link" if out.is_symlink() else "not a directory"
        raise UsageError(f"{where}: exists and is {kind}; refusing to replace it (give a new directory)")
    try:
        ours = _is_drafter_dir(out)
    except OSError as e:
        raise UsageError(f"{where}: cannot read it ({e.strerror or e})") from None
    if not ours:
        raise UsageError(f"{where}: exists and is not an empty or drafter directory (config.json + model.safetensors); "
                         "refusing to replace it (give a new directory)")


def _is_drafter_dir(path: Path) -> bool:
    """Empty, or exactly a drafter's files with a DFlash config.json (what save_drafter writes, or wrote
    before it shipped the modeling file)."""
    names = {p.name for p in path.iterdir()}
    if not names:
        return True
    if not {CONFIG_NAME, WEIGHTS_NAME} <= names <= {CONFIG_NAME, WEIGHTS_NAME, MODELING_NAME} \
            or not (path / WEIGHTS_NAME).is_file():
        return False
    try:
        raw = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("architectures"), list) and \
        "DFlashDraftModel" in raw["architectures"]


def load_config(path: str | os.PathLike, flag: str = "--drafter") -> DFlashConfig:
    cfg_path = Path(path) / CONFIG_NAME
    if not cfg_path.is_file():
        raise UsageError(f"{flag}: {cfg_path} not found (expected a drafter directory with config.json)")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{cfg_path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{flag}: {cfg_path} is not a JSON object (a drafter config.json is one)")
    try:
        return DFlashConfig.from_reference_dict(raw, source=str(cfg_path))
    except (TypeError, ValueError) as e:  # e.g. "block_size": "four"
        raise UsageError(f"{flag}: {cfg_path}: a field has the wrong type ({e})") from None


def load_drafter(path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 flag: str = "--drafter") -> DFlashDrafter:
    """Load a reference-format drafter; every parameter must be present, nothing extra."""
    cfg = load_config(path, flag)
    weights_path = Path(path) / WEIGHTS_NAME
    if not weights_path.is_file():
        raise UsageError(f"{flag}: {weights_path} not found")
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError) as e:
        raise UsageError(f"{weights_path}: unreadable safetensors file ({e})") from None
    # Some exports nest the drafter under `model.`; the reference layout has no prefix.
    state = {k.removeprefix("model."): v for k, v in state.items()}
    with torch.device("meta"):  # every parameter comes from the file: no init (a 1B drafter's took 12 s on 2 cores)
        model = DFlashDrafter(cfg)
    model.rotary = RotaryEmbedding(cfg)  # computed from the config, not stored
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UsageError(f"{weights_path}: weights do not match config.json "
                         f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                         f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''})")
    for name, p in expected.items():
        if state[name].shape != p.shape:
            raise UsageError(f"{weights_path}: {name} has shape {tuple(state[name].shape)}, "
                             f"config implies {tuple(p.shape)}")
    model.load_state_dict(state, assign=True)  # the file's tensors become the parameters
    dtype = dtype or state[next(iter(expected))].dtype
    return model.to(device=device, dtype=dtype).eval()
