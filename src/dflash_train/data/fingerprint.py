"""What a data cache was made from, by content: the conversations' bytes, the tokenizer, the target.

A cache keyed on the `--data` path and the flags goes stale the moment the file behind the path
changes, and a relative path names another file in another directory. These fingerprints change
with what the files hold instead. Each is a small JSON-able dict, so a cache can keep the record of
its inputs beside it and a later run can say which one changed.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dflash_train.data import sharegpt
from dflash_train.models import presets
from dflash_train.models.loading import embedded_gguf_path
from dflash_train.models.target import Target

_CHUNK = 1 << 22
_EDGE = 1 << 20  # bytes hashed at each end of a weights file


def file_sha256(path: Path) -> str:
    """The SHA-256 of every byte of `path`, streamed. Hashing runs at ~2 GB/s, so a few hundred MB of
    conversations cost a fraction of a second, less than loading the target; no stat-based shortcut
    (size + mtime can stay equal across an edit) is worth that risk for the data itself."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def source_fingerprint(source: str) -> dict:
    """The conversations of `--data`: a file's name (records without an id are named after it) and
    the SHA-256 of its bytes; the embedded ShareGPT by its packaged file's bytes alike."""
    path = sharegpt.embedded_path() if source == "sharegpt" else Path(source)
    if not path.is_file():  # reading the source reports it, naming the flag
        return {"source": source}
    return {"source": "sharegpt" if source == "sharegpt" else path.name, "size": path.stat().st_size,
            "sha256": file_sha256(path)}


def weights_fingerprint(path: Path) -> dict:
    """A weights file without reading all of it (an 8B model's are 16 GB): its size, its mtime and a
    hash of its first and last MiB. Rewriting the file changes its mtime; a small file is hashed whole."""
    st = path.stat()
    if st.st_size <= 2 * _EDGE:
        return {"size": st.st_size, "sha256": file_sha256(path)}
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_EDGE))
        f.seek(-_EDGE, os.SEEK_END)
        digest.update(f.read(_EDGE))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "edges_sha256": digest.hexdigest()}


def target_fingerprint(target: Target) -> dict:
    """The target behind the regenerated replies, by what its spec resolves to: a random preset by its
    shape, a GGUF file (the embedded one too) or a model directory by its files, a hub id by the commit
    it was loaded at."""
    spec = target.spec
    if spec.startswith("random:"):
        return {"spec": spec, "shape": presets.PRESETS.get(spec.removeprefix("random:"))}
    if spec == "smollm2-135m":
        return {"spec": spec, "weights": weights_fingerprint(embedded_gguf_path())}
    path = Path(spec)
    if spec.endswith(".gguf") and path.is_file():
        return {"gguf": weights_fingerprint(path)}
    if path.is_dir():
        return {"directory": {p.name: weights_fingerprint(p) for p in sorted(path.iterdir())
                              if p.is_file() and not p.name.startswith(".")}}
    return {"spec": spec, "revision": getattr(target.model.config, "_commit_hash", None)}
