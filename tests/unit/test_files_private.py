"""files' private helpers on real files: folders made 0700 whatever the umask, nothing written
through a symlink, a FIFO or a device, nothing read that another user owns or can write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from areal_cli import files

OTHER = 4242


@pytest.fixture
def umask_000():
    old = os.umask(0)
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_private_dir_makes_every_missing_folder_0700_under_umask_000(tmp_path, umask_000):
    d = files.private_dir(tmp_path / "a" / "b" / "c")
    assert [_mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", d)] == [0o700] * 3
    fd = files.create_new(d / "f")
    os.close(fd)
    files.write_private(d / "g", "x")
    assert _mode(d / "f") == _mode(d / "g") == 0o600


def test_a_folder_others_can_write_or_a_link_is_refused(tmp_path):
    open_ = tmp_path / "open"
    open_.mkdir()
    os.chmod(open_, 0o777)
    with pytest.raises(files.UnsafePath, match="group or others can write"):
        files.private_dir(open_)
    with pytest.raises(files.UnsafePath, match="above it is writable by every user"):
        files.private_dir(open_ / "below")
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(files.UnsafePath, match="symlink"):
        files.check_dir(tmp_path / "link")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a file of another uid")
def test_another_users_folder_and_files_are_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(files.UnsafePath, match=f"belongs to uid {OTHER}"):
        files.check_dir(theirs)
    mine = files.private_dir(tmp_path / "mine")
    (mine / "rec.json").write_text("{}")
    os.chown(mine / "rec.json", OTHER, OTHER)
    with pytest.raises(files.UnsafePath, match=f"belongs to uid {OTHER}"):
        files.read_owned(mine / "rec.json")
    with pytest.raises(files.UnsafePath, match=f"belongs to uid {OTHER}"):
        os.close(files.open_append(mine / "rec.json"))


def test_reads_and_writes_never_go_through_a_link(tmp_path):
    d = files.private_dir(tmp_path / "d")
    target = tmp_path / "target"
    target.write_text("kept\n")
    os.chmod(target, 0o600)
    (d / "log").symlink_to(target)
    with pytest.raises(files.UnsafePath, match="symlink"):
        os.close(files.open_append(d / "log"))
    with pytest.raises(files.UnsafePath, match="symlink"):
        files.write_private(d / "log", "x")
    with pytest.raises(files.UnsafePath, match="symlink"):
        files.read_owned(d / "log")
    with pytest.raises(files.UnsafePath, match="there already"):
        files.create_new(d / "log")
    fd = files.fresh(d / "log")  # the link is taken away, never what it points to
    os.write(fd, b"new\n")
    os.close(fd)
    assert target.read_text() == "kept\n" and (d / "log").read_text() == "new\n"
    assert not (d / "log").is_symlink()


def test_read_owned_refuses_a_file_others_can_write(tmp_path):
    f = tmp_path / "rec.json"
    f.write_text("{}")
    os.chmod(f, 0o666)
    with pytest.raises(files.UnsafePath, match="group or others can write"):
        files.read_owned(f)
    os.chmod(f, 0o644)
    assert files.read_owned(f) == b"{}"


@pytest.mark.parametrize("kind", ["link", "fifo", "folder", "device"])
def test_write_atomic_replaces_only_a_regular_file(tmp_path, kind):
    path = tmp_path / "out"
    if kind == "link":
        path.symlink_to("/dev/null")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path = Path("/dev/null")
    before = path.lstat()
    with pytest.raises(files.UnsafePath, match="refusing to replace"):
        files.write_atomic(path, "secret", mode=0o600)
    after = path.lstat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("name", ["", "/", "."])
def test_write_atomic_refuses_a_path_naming_no_file(name):
    with pytest.raises(files.UnsafePath):
        files.write_atomic(name, "x")
