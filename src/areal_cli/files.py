"""Small files written whole (job records, key files, ready files), and the one error a full
disk gives.

A file is written beside its final name and renamed over it, so a reader sees the old
content or the new, never half. When the write fails the temporary file is removed: a full
disk leaves no empty `.NAME.PID.tmp` behind. A file whose last version must get out even on
a full disk (a job record's final state) keeps a reserve beside it while its job is live:
space that is given back just for that write.

Everything areal keeps of a user's (records, logs, bundles, keys) is made private whatever the
umask, and never through anything another user could have put on the way: `private_dir` makes
a folder 0700 and checks that it is the user's own and that no one else can write it or swap
it; `create_new`, `open_append`, `write_private` and `fresh` open files in such folders
without following a symlink, and `read_owned` reads only a regular file of the user's that no
one else can write. Each refuses anything else with UnsafePath (exit 2, naming the path).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from areal_cli.errors import EXIT_FAILED, ArealError, UsageError

FULL = (errno.ENOSPC, errno.EDQUOT)
RESERVE_BYTES = 64 << 10  # a job record with its failure's log tail is a few KiB


class DiskFull(ArealError):
    """No space (or quota) left where areal writes: exit 1, naming the filesystem."""

    exit_code = EXIT_FAILED


class UnsafePath(UsageError):
    """A path areal will not write through or read from: a symlink, not a regular file or
    folder, another user's, or writable by others (exit 2, naming it and why)."""


PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO never blocks


def is_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in FULL


def disk_full(path: str | Path, e: OSError | None = None) -> DiskFull:
    what = "quota exceeded" if e is not None and e.errno == errno.EDQUOT else "no space left"
    return DiskFull(
        f"{what} on {describe_filesystem(path)}: cannot write {path}",
        hint="free space there, or point AREAL_HOME (--home) at a filesystem with room",
    )


def describe_filesystem(path: str | Path) -> str:
    """'tmpfs at /mnt/x (1.0 MiB, 0 B free)': the mount that holds `path`."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    mount = p
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    kind = "filesystem"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and _unescape(fields[1]) == str(mount):
                    kind = fields[2]  # the last mount on a point is the one seen
    except OSError:
        pass
    try:
        st = os.statvfs(p)
        total, free = human_size(st.f_blocks * st.f_frsize), human_size(st.f_bavail * st.f_frsize)
        size = f" ({total}, {free} free)"
    except OSError:
        size = ""
    return f"{kind} at {mount}{size}"


def full_filesystem(path: str | Path, margin: int = 64 << 10) -> str | None:
    """The filesystem holding `path` described, when it has (almost) no room left."""
    try:
        st = os.statvfs(path if os.path.exists(path) else os.path.dirname(path) or ".")
    except OSError:
        return None
    if st.f_bavail * st.f_frsize > margin and (not st.f_files or st.f_favail > 0):
        return None
    return describe_filesystem(path)


# --------------------------------------------------------------------------- private files


def private_dir(path: str | Path) -> Path:
    """Make `path` a folder only this user can write: each missing folder on the way is made
    0700 whatever the umask, then `check_dir`. Raises UnsafePath, or OSError when a folder
    cannot be made (no permission, a full disk)."""
    path = Path(os.path.abspath(path))
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR)  # the umask can only take bits away from 0700
        except FileExistsError:
            pass  # made by another process meanwhile: checked below like any other
    check_dir(path)
    return path


def check_dir(path: str | Path) -> None:
    """Refuse a folder another user could write into, or swap for one of theirs: it must be
    a real folder (lstat: never a symlink) of this user that group and others cannot write,
    and no folder above it may be writable by every user unless it is sticky (as /tmp is,
    where no one can rename another's entries)."""
    path = Path(os.path.abspath(path))
    try:
        st = os.lstat(path)
    except OSError as e:
        raise UnsafePath(f"cannot use the folder {path}: {e.strerror or e}") from None
    why = _not_private(st, "folder")
    if why:
        raise UnsafePath(
            f"refusing the folder {path}: {why}",
            hint=f"another user could plant or swap what areal writes there; remove it or "
            f"make it yours alone (chmod go-w {path})",
        )
    for up in Path(os.path.realpath(path)).parents:
        try:
            st = os.stat(up)
        except OSError:
            continue
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            raise UnsafePath(
                f"refusing {path}: the folder {up} above it is writable by every user",
                hint=f"any user could swap {path} for a folder of theirs; use a folder under "
                "one that only you (or root) can write",
            )


def _not_private(st: os.stat_result, what: str) -> str | None:
    kind = stat.S_ISDIR if what == "folder" else stat.S_ISREG
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not kind(st.st_mode):
        return f"it is not a {'folder' if what == 'folder' else 'regular file'}"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"group or others can write it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def create_new(path: str | Path, mode: int = PRIVATE_FILE) -> int:
    """A new file at `path` (O_EXCL: never one that is there, never through a symlink) in a
    folder only this user can write; an fd for writing."""
    path = Path(path)
    check_dir(path.parent)
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)
    except FileExistsError:
        raise UnsafePath(
            f"refusing to write {path}: something is there already", hint=f"remove {path}"
        ) from None


def fresh(path: str | Path, mode: int = PRIVATE_FILE) -> int:
    """`create_new` after taking away what is at `path` (a file, a symlink: the link, never
    what it points to). A new inode every time; an fd for appending."""
    path = Path(path)
    check_dir(path.parent)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        pass  # create_new names it
    return _append_fd(create_new(path, mode))


def _append_fd(fd: int) -> int:
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_APPEND) & ~os.O_NONBLOCK)
    return fd


def open_append(path: str | Path, mode: int = PRIVATE_FILE) -> int:
    """An fd appending to this user's regular file at `path` (made `mode` when missing), in a
    folder only this user can write; never through a symlink, never another user's file."""
    path = Path(path)
    check_dir(path.parent)
    return _append_fd(_open_own(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode))


def write_private(path: str | Path, data: str | bytes, mode: int = PRIVATE_FILE) -> None:
    """Write `data` to this user's file at `path`, readable by the user only (`mode`), in a
    folder only the user can write; never through a symlink. An existing file of the user's
    is rewritten and made `mode`."""
    path = Path(path)
    check_dir(path.parent)
    fd = _open_own(path, os.O_WRONLY | os.O_CREAT, mode)
    try:
        os.ftruncate(fd, 0)
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
        view = memoryview(data.encode() if isinstance(data, str) else data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def open_lock(path: str | Path):
    """This user's lock file at `path` opened "a+" (made 0600 when missing), in a folder only
    the user can write; never through a symlink."""
    path = Path(path)
    check_dir(path.parent)
    fd = _open_own(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
    return os.fdopen(_append_fd(fd), "a+")


def _open_own(path: Path, flags: int, mode: int) -> int:
    try:
        fd = os.open(path, flags | _NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"refusing to write {path}: it is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafePath(
                f"refusing to write {path}: {_not_private(st, 'file')}", hint=f"remove {path}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_owned(path: str | Path, limit: int = 16 << 20) -> bytes:
    """The content of this user's regular file at `path` that no one else can write (at most
    `limit` bytes). FileNotFoundError when there is none; UnsafePath when it is a symlink,
    not a regular file, another user's, or writable by others."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{path}: it is a symlink") from None
        raise
    try:
        why = _not_private(os.fstat(fd), "file")
        if why:
            raise UnsafePath(f"{path}: {why}")
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def kind_of(mode: int) -> str:
    """What a file of st_mode `mode` is, in the words of an error message."""
    kinds = (
        (stat.S_ISREG, "a regular file"), (stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
        (stat.S_ISSOCK, "a socket"),
    )  # fmt: skip
    return next((word for test, word in kinds if test(mode)), "not a file")


def check_replaceable(path: str | Path) -> None:
    """Refuse a `path` whose replacing would destroy something other than a regular file (a
    symlink such as /dev/stdout, a device, a FIFO, a folder): UnsafePath naming it."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise UnsafePath(f"refusing to write {str(path)!r}: it names a folder, not a file")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UnsafePath(f"cannot write {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(
            f"refusing to replace {path}: it is {kind_of(st.st_mode)}",
            hint="name a regular file (or a new one); `-` writes to stdout",
        )


def write_atomic(
    path: str | Path,
    data: str | bytes,
    *,
    mode: int = 0o644,
    reserve: bool | None = None,
) -> None:
    """Write `data` to `path` whole. `reserve`: True keeps a reserve beside the file (made
    when there is room), False gives it up, None leaves it be; on a full disk the reserve is
    given back and the write tried once more. Only a regular file (or nothing) is replaced
    (check_replaceable). Raises DiskFull on a full disk, UnsafePath, OSError otherwise; no
    temporary file is left either way."""
    path = Path(path)
    check_replaceable(path)
    spare = path.with_name(f".{path.name}.reserve")
    raw = data.encode() if isinstance(data, str) else data
    try:
        _replace(path, raw, mode)
    except OSError as e:
        if not is_full(e):
            raise
        try:
            spare.unlink()
        except OSError:
            raise disk_full(path, e) from None
        try:
            _replace(path, raw, mode)
        except OSError as e2:
            if is_full(e2):
                raise disk_full(path, e2) from None
            raise
        return  # the reserve is spent: it is not made again on a disk this full
    if reserve is False:
        spare.unlink(missing_ok=True)
    elif reserve and not spare.exists():
        _make_reserve(spare)


def _replace(path: Path, raw: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink()  # one a process of this pid left behind, or a planted link: never followed
    except FileNotFoundError:
        pass
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def _make_reserve(spare: Path) -> None:
    try:
        fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return
    try:
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.write(fd, bytes(RESERVE_BYTES))  # a filesystem without fallocate
    except OSError:
        os.close(fd)
        spare.unlink(missing_ok=True)  # no room for it: the write itself came first
        return
    os.close(fd)


def human_size(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _unescape(field: str) -> str:
    """/proc/self/mounts writes spaces and tabs in paths as octal escapes."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
