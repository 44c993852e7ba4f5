"""`areal doctor check --scheduler ray`: the Ray client here, the cluster (reached, its auth,
its version), its nodes and what they hold, and whether every node sees the files areal
shares through the filesystem (logs, the job's plan, a file registry)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from areal_cli import settings
from areal_cli.diagnose.check import FAIL, PASS, WARN, Row
from areal_cli.errors import ArealError
from areal_cli.registry import open_registry
from areal_cli.schedulers.ray import cluster


def rows(home: Path, registry: str, address: str | None = None) -> list:
    try:
        import ray  # optional: areal-cli[ray]
    except ImportError:
        return [Row("ray", FAIL, "Ray is not installed in this interpreter",
                    "pip install 'areal-cli[ray]' (the cluster's Ray version)")]  # fmt: skip
    try:
        addr = cluster.connect(address)
    except ArealError as e:
        return [Row("ray", FAIL, f"ray {ray.__version__}: {e.message}", e.hint)]
    auth = os.environ.get("RAY_AUTH_MODE") or "unset"
    nodes = cluster.nodes()
    versions = _cluster_versions()
    other = sorted(v for v in versions if v != ray.__version__)
    out = [
        Row("ray", WARN if other else PASS,
            f"ray {ray.__version__} here; cluster at {addr} (RAY_AUTH_MODE {auth})"
            + (f", its nodes run {', '.join(other)}" if other else ""),
            "install the cluster's Ray version here" if other else None),
        Row("ray nodes", PASS if nodes else FAIL,
            "; ".join(n.describe() for n in nodes) or "no live node",
            None if nodes else "start the cluster's nodes (`ray start --address HEAD:PORT`)"),
    ]  # fmt: skip
    out.append(_shared_fs(home, registry, nodes))
    return out


def _cluster_versions() -> set[str]:
    import ray

    try:
        return {str(n.get("RayVersion") or ray.__version__) for n in ray.nodes() if n["Alive"]}
    except Exception:
        return set()


def _read(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        try:
            out.append(Path(p).read_text().strip())
        except OSError as e:
            out.append(f"! {e.strerror or e}")
    return out


def _shared_fs(home: Path, registry: str, nodes) -> object:
    """Write a probe where logs and a file registry live; read it back from a task on every
    node (node affinity, no resources held)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    places = {"logs": home / "logs" / settings.user()}
    reg = open_registry(registry)
    if reg.shared_filesystem:  # its entries are files under its folder, its url
        places["registry"] = Path(reg.url) / settings.user()
    probes = []
    try:
        for d in places.values():
            d.mkdir(parents=True, exist_ok=True)
            probe = d / f".areal-fs-check-{token}"
            probe.write_text(token + "\n")
            probes.append(str(probe))
    except OSError as e:
        return Row("shared filesystem", FAIL, f"cannot write {d}: {e.strerror or e}",
                   "pick a writable --home / --registry")  # fmt: skip
    what = " and ".join(f"{k} ({v})" for k, v in places.items())
    fix = ("put AREAL_HOME (--home) and the registry on a filesystem every node mounts "
           "(NFS, Lustre, ...), or use an etcd registry (--registry etcd://HOST:PORT)")  # fmt: skip
    try:
        fn = ray.remote(num_cpus=0, max_retries=0)(_read)
        refs = {
            n.ip: fn.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)
            ).remote(probes)
            for n in nodes
        }
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=60)
        seen = {ip: ray.get(ref) for ip, ref in refs.items() if ref in ready}
    finally:
        for p in probes:
            Path(p).unlink(missing_ok=True)
    if len(seen) < len(refs):
        late = sorted(set(refs) - set(seen))
        return Row("shared filesystem", WARN, f"not checked on {', '.join(late)}: no answer "
                   "within 60s", "try again when the cluster is less busy")  # fmt: skip
    blind = sorted(ip for ip, got in seen.items() if got != [token] * len(probes))
    if blind:
        return Row("shared filesystem", FAIL, f"node(s) {', '.join(blind)} do not see {what}",
                   fix)  # fmt: skip
    return Row("shared filesystem", PASS, f"{what} seen from {len(seen)} Ray node(s)")
