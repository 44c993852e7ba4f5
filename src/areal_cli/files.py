"""Small files written whole (job records, key files, ready files), and the one error a full
disk gives.

A file is written beside its final name and renamed over it, so a reader sees the old
content or the new, never half. When the write fails the temporary file is removed: a full
disk leaves no empty `.NAME.PID.tmp` behind. A file whose last version must get out even on
a full disk (a job record's final state) keeps a reserve beside it while its job is live:
space that is given back just for that write.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from areal_cli.errors import EXIT_FAILED, ArealError

FULL = (errno.ENOSPC, errno.EDQUOT)
RESERVE_BYTES = 64 << 10  # a job record with its failure's log tail is a few KiB


class DiskFull(ArealError):
    """No space (or quota) left where areal writes: exit 1, naming the filesystem."""

    exit_code = EXIT_FAILED


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
        size = f" ({_size(st.f_blocks * st.f_frsize)}, {_size(st.f_bavail * st.f_frsize)} free)"
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


def write_atomic(
    path: str | Path,
    data: str | bytes,
    *,
    mode: int = 0o644,
    reserve: bool | None = None,
) -> None:
    """Write `data` to `path` whole. `reserve`: True keeps a reserve beside the file (made
    when there is room), False gives it up, None leaves it be; on a full disk the reserve is
    given back and the write tried once more. Raises DiskFull on a full disk, OSError
    otherwise; no temporary file is left either way."""
    path = Path(path)
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
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
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


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _unescape(field: str) -> str:
    """/proc/self/mounts writes spaces and tabs in paths as octal escapes."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
