"""The registry of live inference servers and training ranks (see api.py for the layout).
Each kind is a plug-in of entry-point group `areal_cli.registries` named by its URL's
scheme (plugins.py): areal ships `file` (a path is a file URL) and `etcd`.

reg = open_registry()                       # AREAL_REGISTRY, a path, file:// or etcd://
reg.register(ServerEntry(...), ttl=30)      # under a lease; renew with reg.keepalive(e)
reg.list("exp", "trial0").servers           # live entries only
"""

from __future__ import annotations

from pathlib import Path

from areal_cli import plugins, settings
from areal_cli.registry.api import (
    DEFAULT_TTL,
    OWN_KEY,
    SERVERS_KEY,
    Listing,
    RankEntry,
    Registry,
    ServerEntry,
    Skip,
    server_id,
)
from areal_cli.registry.file import FileRegistry

__all__ = [
    "DEFAULT_TTL",
    "OWN_KEY",
    "SERVERS_KEY",
    "FileRegistry",
    "Listing",
    "RankEntry",
    "Registry",
    "ServerEntry",
    "Skip",
    "open_registry",
    "registry_class",
    "server_id",
]


def open_registry(url: str | Path | None = None) -> Registry:
    """The one registry object serve, train, ps, stop, the doctor and the workers use."""
    resolved = settings.registry_url(url)
    return registry_class(resolved).from_url(resolved)


def registry_class(url: str | Path | None = None) -> type[Registry]:
    """The class of the registry at `url` (its scheme's plug-in), without opening it."""
    return plugins.load(plugins.REGISTRIES, settings.registry_scheme(url), base=Registry)
