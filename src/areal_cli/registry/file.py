"""The file registry: AReaL's NFS name_resolve layout in a directory that may be shared.

A key is a directory and its value the one file `ENTRY` inside it:

    <root>/<user>/<experiment>/<trial>/gen_servers/<id>/ENTRY        "host:port"
    <root>/<user>/<experiment>/<trial>/areal/servers/<id>/ENTRY      JSON metadata
    <root>/<user>/<experiment>/<trial>/areal/ranks/<rank>/ENTRY      JSON

AReaL's reader walks `gen_servers/` and takes every directory holding exactly one file named
ENTRY, so writes are atomic renames of a temp file kept in the parent directory, never beside
ENTRY. There are no real leases here: the metadata carries a heartbeat and a TTL, and readers
skip an entry whose heartbeat is older than its TTL or whose pid is gone on this host.

The root is shared by every user of a host, like /tmp (mode 1777), so nothing in it is
trusted by default. Each user's directory is created private to its user. Readers take a
user's tree only when that directory is the user's own and writable by no one else, and
from it only ENTRY files that are themselves the user's, writable by no one else, regular
files (never through a symlink, never a FIFO) of at most MAX_VALUE bytes: whatever another
user manages to put into a folder, a file they made is never read as ours.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import time
import uuid
from pathlib import Path

from areal_cli import settings
from areal_cli.errors import UsageError
from areal_cli.registry.api import Registry, Skip

ENTRY = "ENTRY"
MAX_VALUE = 64 * 1024  # entries are a few hundred bytes; anything bigger is not ours
ATTEMPTS = 50  # to write while other writers prune the folders on the way
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class FileRegistry(Registry):
    kind = "file"
    shared_filesystem = True

    def __init__(self, root: Path | str, user: str | None = None):
        self.root = Path(root)
        self.user = user or settings.user()
        self.url = str(self.root)
        self._uid = _uid_of(self.user)

    def for_user(self, user: str) -> FileRegistry:
        return FileRegistry(self.root, user)

    def users(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False))
        except OSError:
            return []

    def where(self, experiment: str, trial: str) -> str:
        return str(self.root / self._trial_key(experiment, trial) / "gen_servers")

    def areal_name_resolve(self) -> list[str]:
        return [
            "cluster.name_resolve.type=nfs",
            f"cluster.name_resolve.nfs_record_root={self.root}",
        ]

    def trial_dir(self, experiment: str, trial: str) -> Path:
        return self.root / self._trial_key(experiment, trial)

    # -- writes ---------------------------------------------------------------------------

    def _put(self, key: str, value: str, lease: str | None = None) -> None:
        path = self.root / key / ENTRY
        # The temp file sits in the parent, not beside ENTRY: AReaL's reader would skip a
        # directory holding two files, and ours would call it half-written.
        tmp = path.parent.parent / f".{path.parent.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        for attempt in range(ATTEMPTS):
            try:
                self._make_dirs(path.parent)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                break
            except FileNotFoundError:
                # Another writer's delete pruned the (then empty) folders on our way: try
                # again after it, at a random moment so that two writers do not keep meeting.
                if attempt == ATTEMPTS - 1:
                    raise
                time.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        try:
            with os.fdopen(fd, "w") as f:
                f.write(value)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _delete(self, key: str) -> bool:
        d = self.root / key
        try:
            shutil.rmtree(d)
        except FileNotFoundError:
            return False  # gone already (another writer's delete got there first)
        d = d.parent
        # The user's own folder stays: it carries the ownership readers check.
        while d != self.root / self.user and self.root in d.parents:
            try:
                d.rmdir()
            except OSError:
                break
            d = d.parent
        return True

    def _make_dirs(self, d: Path) -> None:
        if not self.root.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            try:
                # Shared by every user of the host (each writes under its own name), like /tmp.
                os.chmod(self.root, 0o1777)
            except OSError:
                pass
        mine = self.root / self.user
        try:
            mine.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.lstat(mine)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise UsageError(
                f"the registry folder {mine} is not yours (owner uid {st.st_uid}"
                + (", a symlink" if stat.S_ISLNK(st.st_mode) else "")
                + "): another user may have planted it",
                hint=f"remove it ({mine}) or pick another --registry (or AREAL_REGISTRY)",
            )
        # No group/other write bits on the way, whatever the umask: readers refuse those.
        rel = d.relative_to(mine)
        cur = mine
        for part in rel.parts:
            cur = cur / part
            try:
                cur.mkdir(mode=0o755)
            except FileExistsError:
                pass

    # -- reads ----------------------------------------------------------------------------

    def _read_prefix(self, prefix: str) -> dict[str, str | Skip]:
        out: dict[str, str | Skip] = {}
        user_dir = self.root / self.user
        why = self._untrusted(user_dir)
        if why:
            if why != "missing":
                out[self.user] = Skip(why)
            return out
        start = self.root / prefix
        # Every directory between the user's and the prefix must be trustworthy too.
        cur = user_dir
        for part in Path(prefix).parts[1:]:
            cur = cur / part
            why = self._untrusted(cur)
            if why:
                if why != "missing":
                    out[prefix] = Skip(why)
                return out
        self._walk(str(start), prefix, out)
        return out

    def _walk(self, d: str, key: str, out: dict[str, str | Skip]) -> None:
        # Plain strings and one open per entry: this runs for every server on every listing.
        value = self._read_value(os.path.join(d, ENTRY))
        if value is not None:
            out[key] = value
            return
        try:
            with os.scandir(d) as it:
                found = list(it)
        except OSError:
            return
        subdirs = [
            e for e in found if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
        ]
        if not subdirs and found and key.count("/") >= 4:
            tmp = any(".tmp" in e.name for e in found)
            out[key] = Skip("half-written" if tmp else "no ENTRY")
            return
        for e in subdirs:
            self._walk(e.path, f"{key}/{e.name}", out)

    def _read_value(self, path: str) -> str | Skip | None:
        """The value, a Skip saying why it is not to be used, or None: no ENTRY here."""
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as e:
            # ELOOP: ENTRY is a symlink (O_NOFOLLOW); ENXIO: a FIFO with no writer.
            return Skip(f"unreadable ENTRY ({e.strerror or e})")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return Skip("ENTRY is not a regular file")
            why = self._check(st)
            if why:
                return Skip(why)
            if st.st_size > MAX_VALUE:
                return Skip(f"ENTRY is larger than {MAX_VALUE // 1024} KiB")
            data = os.read(fd, MAX_VALUE + 1)
            if len(data) > MAX_VALUE:
                return Skip(f"ENTRY is larger than {MAX_VALUE // 1024} KiB")
            return data.decode(errors="replace")
        except OSError as e:
            return Skip(f"unreadable ENTRY ({e.strerror or e})")
        finally:
            os.close(fd)

    def _untrusted(self, path: Path) -> str | None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return "missing"
        except OSError as e:
            return f"unreadable ({e.strerror or e})"
        if stat.S_ISLNK(st.st_mode):
            return "untrusted: a symlink"
        if not stat.S_ISDIR(st.st_mode):
            return "untrusted: not a directory"
        return self._check(st)

    def _check(self, st: os.stat_result) -> str | None:
        if self._uid is None or st.st_uid != self._uid:
            return f"untrusted: owned by uid {st.st_uid}, not {self.user}"
        if st.st_mode & 0o022:
            return "untrusted: writable by group or others"
        return None


def _uid_of(user: str) -> int | None:
    if user == settings.user():
        return os.getuid()
    import pwd

    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return int(user) if user.isdigit() else None
