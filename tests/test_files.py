"""files.py: the one atomic writer (files and directories), its leftovers, the package-file locator; errors.say."""

import fnmatch
import os

import pytest

from dflash_train import files
from dflash_train.errors import UsageError, say
from dflash_train.files import AtomicDirectory, leftovers, package_file, write_atomic


def _fill(tmp, text):
    (tmp / "sub").mkdir()
    (tmp / "a.txt").write_text(text)
    (tmp / "sub" / "b.txt").write_text(text)


def test_directory_is_created_then_replaced_whole(tmp_path):
    out = tmp_path / "deep" / "out"
    with AtomicDirectory(out) as tmp:
        assert tmp.parent == out.parent and tmp.is_dir() and not out.exists()
        _fill(tmp, "one")
        (tmp / "only-in-one").write_text("x")
    assert (out / "a.txt").read_text() == "one" and (out / "only-in-one").exists()
    with AtomicDirectory(out) as tmp:
        _fill(tmp, "two")
    assert (out / "sub" / "b.txt").read_text() == "two"
    assert not (out / "only-in-one").exists()  # the old directory is gone, not merged
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no temporaries left


def test_failing_block_leaves_the_old_directory_and_no_temporary(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("old")
    with pytest.raises(RuntimeError), AtomicDirectory(out) as tmp:
        _fill(tmp, "new")
        raise RuntimeError("disk full")
    assert [p.name for p in out.iterdir()] == ["keep"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("old")
    real = os.rename

    def rename(src, dst):
        if ".tmp-" in str(src):  # the new directory's rename into place
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(files.os, "rename", rename)
    with pytest.raises(OSError), AtomicDirectory(out) as tmp:
        _fill(tmp, "new")
    assert (out / "keep").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_replace_false_keeps_an_existing_directory(tmp_path):
    out = tmp_path / "cache"
    out.mkdir()
    (out / "theirs").write_text("first writer")
    with pytest.raises(OSError), AtomicDirectory(out, replace=False) as tmp:
        _fill(tmp, "second writer")
    assert [p.name for p in out.iterdir()] == ["theirs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_everything_is_flushed_before_the_rename(tmp_path, monkeypatch):
    out = tmp_path / "out"
    synced, renamed = [], []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(files.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                        real_fsync(fd)))
    monkeypatch.setattr(files.os, "rename", lambda a, b: (renamed.append(len(synced)), real_rename(a, b)))
    with AtomicDirectory(out) as tmp:
        _fill(tmp, "x")
    before = {os.path.relpath(p, tmp) for p in synced[:renamed[0]]}
    assert before == {"a.txt", "sub/b.txt", "sub", "."}  # files, then directories' entries
    assert str(tmp_path) in synced[renamed[0]:]  # and the rename itself


def test_write_atomic_replaces_a_file(tmp_path):
    path = tmp_path / "latest"
    path.write_text("old\n")
    write_atomic(path, lambda f: f.write(b"new\n"))
    assert path.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["latest"]
    def half(f):
        f.write(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_atomic(path, half)
    assert path.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_leftovers_match_every_temporary_name_and_nothing_else(tmp_path, monkeypatch):
    seen = []
    write_atomic(tmp_path / "latest", lambda f: seen.extend(p.name for p in tmp_path.iterdir()))
    staged = AtomicDirectory(tmp_path / "step_0000003")
    seen.append(staged.tmp.name)
    real = os.rename
    monkeypatch.setattr(files.os, "rename", lambda a, b: (seen.append(os.path.basename(b)), real(a, b)))
    with staged:
        pass
    with AtomicDirectory(tmp_path / "step_0000003"):  # replaces: sets the old one aside first
        pass
    temporaries = [n for n in seen if n.startswith(".")]
    assert len(temporaries) == 3  # write_atomic's file, a new directory, a set-aside one
    assert all(fnmatch.fnmatch(n, p) for n in temporaries if "latest" in n for p in leftovers("latest"))
    assert all(any(fnmatch.fnmatch(n, p) for p in leftovers("step_*")) for n in temporaries if "step" in n)
    assert not any(fnmatch.fnmatch(n, p) for n in ("step_0000003", ".lock", ".my-notes", "latest")
                   for p in leftovers("step_*") + leftovers("latest"))


def test_package_file_is_found_without_importing_the_package(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_pkg_h18"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('needs a dependency a --no-deps install lacks')\n")
    (pkg / "data" / "x.json").write_text("[]")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert package_file("fake_pkg_h18", "data/x.json", dist="fake-pkg", flag="--f") == pkg / "data" / "x.json"
    with pytest.raises(UsageError, match=r"^--f: fake-pkg is installed but data/y.json is missing"):
        package_file("fake_pkg_h18", "data/y.json", dist="fake-pkg", flag="--f")
    with pytest.raises(UsageError, match=r"^--f: needs PyPI no-pkg \(pip install --no-deps no-pkg\)$"):
        package_file("no_such_pkg_h18", "x", dist="no-pkg", flag="--f")
    with pytest.raises(UsageError, match=r"\(pip install no-pkg\)$"):
        package_file("no_such_pkg_h18", "x", dist="no-pkg", flag="--f", no_deps=False)


def test_say_writes_one_prefixed_line_to_stderr(capsys):
    say("hello")
    out, err = capsys.readouterr()
    assert out == "" and err == "[dflash-train] hello\n"
