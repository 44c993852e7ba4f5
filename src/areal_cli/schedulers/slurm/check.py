"""`areal doctor check --scheduler slurm`: Slurm's version and controller, each partition's
nodes and GPUs per node, and whether the nodes see the files areal writes."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

from areal_cli import settings
from areal_cli.diagnose.check import FAIL, PASS, WARN, Row
from areal_cli.errors import ArealError
from areal_cli.registry import open_registry
from areal_cli.schedulers.slurm import cluster


def rows(home: Path, registry: str) -> list[Row]:
    """The cluster as `--scheduler slurm` sees it: Slurm's version and controller, each
    partition's nodes and GPUs per node, and whether the nodes see the files areal writes."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return [Row("slurm", FAIL, "sbatch/sinfo not on PATH",
                    "run on a Slurm login node, or install slurm-client (set SLURM_CONF)")]  # fmt: skip
    try:
        version = cluster.version() or "unknown version"
        ping = cluster.run(["scontrol", "ping"], timeout=15)
        parts = cluster.partitions()
    except ArealError as e:
        return [Row("slurm", FAIL, e.message, e.hint or "is slurmctld up? `scontrol ping`")]
    up = "UP" in ping.stdout
    rows = [
        Row("slurm", PASS if up else FAIL, f"{version}; {ping.stdout.strip() or 'controller?'}",
            None if up else "start slurmctld, or point SLURM_CONF at the cluster's slurm.conf")
    ]  # fmt: skip
    for p in parts:
        detail = (
            f"{len(p.nodes)} node(s) ({','.join(p.nodes[:8])}{' ...' if len(p.nodes) > 8 else ''}), "
            f"{p.gpus_per_node} GPU(s) and {p.cpus_per_node} CPUs per node, {p.state}"
            + (", the default" if p.default else "")
        )
        status = PASS if p.gpus_per_node and p.state == "up" else WARN
        fix = None
        if not p.gpus_per_node:
            fix = "no GPUs (gres gpu): only the hf backend on CPU runs here"
        elif p.state != "up":
            fix = f"partition {p.name} is {p.state}"
        rows.append(Row(f"partition {p.name}", status, detail, fix))
    default = next((p for p in parts if p.default), parts[0] if parts else None)
    if default is not None and up:
        rows.append(shared_fs_row(home, registry, default))
    return rows


def shared_fs_row(home: Path, registry: str, partition) -> Row:
    """Write a file where logs and the (file) registry live, and read it back from nodes of a
    short job: a folder only this host sees breaks logs, discovery and the job's own plan."""
    token = secrets.token_hex(8)
    places = {"logs": home / "logs" / settings.user()}
    reg = open_registry(registry)
    if reg.shared_filesystem:  # its entries are files under its folder, its url
        places["registry"] = Path(reg.url) / settings.user()
    probes = {}
    try:
        for what, d in places.items():
            d.mkdir(parents=True, exist_ok=True)
            probes[what] = d / f".areal-fs-check-{token}"
            probes[what].write_text(token + "\n")
    except OSError as e:
        return Row("shared filesystem", FAIL, f"cannot write {d}: {e.strerror or e}",
                   "pick a writable --home / --registry")  # fmt: skip
    n = min(2, len(partition.nodes))
    try:
        res = cluster.run(
            ["srun", f"--partition={partition.name}", f"--nodes={n}", "--ntasks-per-node=1",
             "--immediate=10", "--time=1", "--quiet", "--label", "cat", *map(str, probes.values())],
            timeout=60,
        )  # fmt: skip
    except ArealError as e:
        res = None
        why = e.message
    finally:
        for p in probes.values():
            p.unlink(missing_ok=True)
    what = " and ".join(f"{k} ({places[k]})" for k in places)
    fix = "put AREAL_HOME (--home) and the registry on a filesystem every node mounts "
    fix += "(NFS, Lustre, ...), or use an etcd registry (--registry etcd://HOST:PORT)"
    if res is None or res.returncode != 0:
        why = cluster.slurm_message(res.stderr) if res is not None else why
        if res is not None and "No such file" in res.stderr:
            return Row("shared filesystem", FAIL, f"the nodes do not see {what}: {why}", fix)
        return Row("shared filesystem", WARN, f"not checked: no short job ran ({why})",
                   f"try again when a node of partition {partition.name} is free")  # fmt: skip
    seen = [line.split(":", 1)[1].strip() for line in res.stdout.splitlines() if ":" in line]
    want = n * len(probes)
    if seen.count(token) < want:
        return Row("shared filesystem", FAIL, f"{n} node(s) read {what} differently", fix)
    return Row("shared filesystem", PASS, f"{what} seen from {n} node(s) of {partition.name}")
