"""The toy registry, scheme `toy://PATH`: AReaL's file layout under PATH, and one line per
write and read in PATH.audit, so that a test sees who went through it."""

from __future__ import annotations

import os
from pathlib import Path

from areal_cli.registry.file import FileRegistry

SCHEME = "toy://"


class ToyRegistry(FileRegistry):
    kind = "toy"

    def __init__(self, root, user=None):
        super().__init__(root, user)
        self.url = SCHEME + str(self.root)

    @classmethod
    def from_url(cls, url: str) -> ToyRegistry:
        return cls(url[len(SCHEME) :])

    def for_user(self, user: str) -> ToyRegistry:
        return ToyRegistry(self.root, user)

    def _audit(self, what: str, key: str) -> None:
        line = f"{os.getpid()} {what} {key}\n"
        with open(Path(f"{self.root}.audit"), "a") as f:
            f.write(line)

    def _put(self, key, value, lease=None):
        self._audit("put", key)
        return super()._put(key, value, lease)

    def _read_prefix(self, prefix):
        self._audit("read", prefix)
        return super()._read_prefix(prefix)
