"""The registry of live inference servers and training ranks (see api.py for the layout).

reg = open_registry()                       # AREAL_REGISTRY, a path, file:// or etcd://
reg.register(ServerEntry(...), ttl=30)      # under a lease; renew with reg.keepalive(e)
reg.list("exp", "trial0").servers           # live entries only
"""

from __future__ import annotations

from pathlib import Path

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
    "server_id",
]


def open_registry(url: str | Path | None = None) -> Registry:
    """The one registry object serve, train, ps, stop, the doctor and the workers use."""
    from areal_cli.settings import registry_url

    resolved = registry_url(url)
    if resolved.startswith("etcd://"):
        from areal_cli.registry.etcd import EtcdRegistry

        return EtcdRegistry.from_url(resolved)
    return FileRegistry(resolved)
