"""Slurm's own commands, run and read: sbatch, squeue --json, scancel, sinfo, scontrol.

Every call is bounded in time; a missing command is a usage error with the way out; a refusal
by Slurm keeps Slurm's own words. A controller that does not answer (a timeout, a refused
connection, or squeue's JSON carrying `errors` beside an empty job list, which is how 22.05
reports a timeout with exit 0) is `Unreachable`, never an empty answer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from areal_cli import settings
from areal_cli.errors import ArealError, LaunchError, UsageError, WaitTimeout

# Slurm's job states (squeue) in our words (schedulers.api LIVE / ENDED).
STATES = {
    "PENDING": "pending",
    "REQUEUED": "pending",
    "REQUEUE_HOLD": "pending",
    "REQUEUE_FED": "pending",
    "SUSPENDED": "pending",
    "RESV_DEL_HOLD": "pending",
    "CONFIGURING": "starting",
    "RUNNING": "running",
    "RESIZING": "running",
    "SIGNALING": "running",
    "STAGE_OUT": "stopping",
    "COMPLETING": "stopping",
    "STOPPED": "stopping",
    "COMPLETED": "stopped",
    "CANCELLED": "cancelled",
    "FAILED": "failed",
    "TIMEOUT": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
    "PREEMPTED": "killed",
    "REVOKED": "cancelled",
    "SPECIAL_EXIT": "failed",
}

# sbatch refusals that are the user's input (a name, a size, a limit), not a broken cluster.
_BAD_INPUT = re.compile(
    r"invalid (partition|account|qos|generic resource|gres|feature|node name|time limit|"
    r"wckey|reservation|job id)|not permitted|node configuration is not available|"
    r"more processors requested than permitted|time limit|invalid.*specification|"
    r"unrecognized option|invalid option|invalid argument|illegal",
    re.IGNORECASE,
)


# How Slurm's clients say that the controller did not answer (src/common/slurm_errno.c).
_NO_ANSWER = re.compile(
    r"socket timed out|unable to contact slurm controller|connection refused|connect failure|"
    r"zero bytes were transmitted|communication connection failure|slurmctld.*not responding|"
    r"connection timed out",
    re.IGNORECASE,
)


class Unreachable(WaitTimeout):
    """The controller did not answer: nothing can be concluded about any job (exit 3)."""


def controller() -> str:
    """The controller as slurm.conf names it ("slurmctld at vm:20121"), for messages."""
    conf = os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    hosts, port = [], "6817"
    try:
        text = open(conf).read(1 << 20)
    except OSError:
        return "slurmctld"
    for line in text.splitlines():
        key, _, value = line.split("#")[0].partition("=")
        key, value = key.strip().lower(), value.strip()
        if key in ("slurmctldhost", "controlmachine") and value:
            hosts.append(value.split("(")[0])
        elif key == "slurmctldport" and value:
            port = value
    if not hosts:
        return "slurmctld"
    return "slurmctld at " + ", ".join(f"{h}:{port}" for h in hosts)


def _unreachable(what: str, why: str, after: str = "nothing was changed") -> Unreachable:
    return Unreachable(
        f"{controller()} did not answer {what} ({why}); {after}",
        hint="`scontrol ping` tells whether it is up; try again when it answers "
        "(AREAL_SLURM_TIMEOUT sets how long areal waits)",
    )


@dataclass
class JobInfo:
    """One Slurm job as squeue sees it; a heterogeneous job's components merged."""

    job_id: str
    slurm_state: str  # of the first component ("RUNNING", "CANCELLED", ...)
    nodes: list[str] = field(default_factory=list)
    reason: str | None = None
    exit_code: int | None = None  # the batch script's, as the shell reports it (128+signal)
    start_time: float | None = None
    end_time: float | None = None
    components: dict[int, list[str]] = field(default_factory=dict)  # het offset -> nodes

    @property
    def state(self) -> str:
        return STATES.get(self.slurm_state, self.slurm_state.lower())


def require(tool: str = "sbatch") -> str:
    """The path of a Slurm command, or a usage error saying how to get one."""
    path = shutil.which(tool)
    if path is None:
        raise UsageError(
            f"{tool} is not on PATH: this host cannot submit Slurm jobs",
            hint="run areal on a Slurm login node, install the client (Debian/Ubuntu: "
            "apt-get install slurm-client; set SLURM_CONF), or use --scheduler local",
        )
    return path


def run(argv: list[str], timeout: float | None = None, input: str | None = None):
    require(argv[0])
    timeout = settings.slurm_timeout() if timeout is None else timeout
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, input=input, check=False
        )
    except subprocess.TimeoutExpired:
        raise _unreachable(f"`{' '.join(argv[:3])}`", f"no reply within {timeout:g}s") from None


def slurm_message(stderr: str) -> str:
    """Slurm's error lines without the tool's prefix, one message."""
    lines = []
    for line in stderr.splitlines():
        line = line.strip()
        for prefix in ("sbatch: error: ", "srun: error: ", "error: ", "sbatch: ", "srun: "):
            line = line.removeprefix(prefix)
        if line and line not in lines:
            lines.append(line)
    return "; ".join(lines) or "no message"


def sbatch(script_path: str, name: str | None = None) -> str:
    """Submit a batch script; the job id. Slurm refusing the user's input is exit 2 with
    Slurm's own message; a controller that does not answer exit 3 (the request may still
    reach it, so the message says how to find and cancel the job by its `name`)."""
    later = "it may still queue the job once it answers" + (
        f": `squeue --me --name={name}` shows it, `scancel --me --name={name}` cancels it"
        if name
        else ""
    )
    timeout = 2 * settings.slurm_timeout()
    try:
        res = run(["sbatch", "--parsable", script_path], timeout=timeout)
    except Unreachable:
        raise _unreachable("sbatch", f"no reply within {timeout:g}s", later) from None
    if res.returncode != 0:
        message = slurm_message(res.stderr)
        if "connection refused" in message.lower() or "connect failure" in message.lower():
            raise _unreachable("sbatch", message, "the job was not submitted")
        if _NO_ANSWER.search(message):
            raise _unreachable("sbatch", message, later)
        cls = UsageError if _BAD_INPUT.search(message) else LaunchError
        raise cls(
            f"Slurm refused the job: {message}",
            hint="`sinfo` lists partitions and their nodes; `sacctmgr show assoc user=$USER` "
            "your accounts (where the cluster keeps them)",
        )
    return res.stdout.strip().split(";")[0]


def jobs(ids: list[str]) -> dict[str, JobInfo]:
    """What squeue knows of these jobs (ended ones for a few minutes: MinJobAge); one call."""
    if not ids:
        return {}
    res = run(["squeue", "--json", "--me", "--states=all"])
    if res.returncode != 0:
        message = slurm_message(res.stderr)
        if _NO_ANSWER.search(message):
            raise _unreachable("squeue", message)
        raise LaunchError(f"squeue failed: {message}")
    try:
        doc = json.loads(res.stdout)
    except ValueError:
        raise LaunchError("squeue --json printed something that is not JSON") from None
    return parse_jobs(doc, ids)


def parse_jobs(doc: dict, ids: list[str]) -> dict[str, JobInfo]:
    """squeue --json's document → our jobs of `ids`. Any error in it means the list is not the
    controller's answer (22.05 reports a controller timeout as errors + an empty list)."""
    errors = doc.get("errors") or []
    if errors:
        why = "; ".join(
            ": ".join(str(x) for x in (e.get("description"), e.get("error")) if x)
            if isinstance(e, dict)
            else str(e)
            for e in errors
        )
        raise _unreachable("squeue", why or "errors in its answer")
    data = doc.get("jobs", [])
    # Older squeue ignores filters in JSON mode: pick ours here.
    wanted = set(ids)
    out: dict[str, JobInfo] = {}
    for j in sorted(data, key=lambda j: j.get("het_job_offset") or 0):
        # A heterogeneous job's components carry the id sbatch printed as het_job_id.
        jid = str(j.get("het_job_id") or j.get("job_id"))
        if jid not in wanted:
            continue
        nodes = expand(j.get("nodes") or "")
        offset = int(j.get("het_job_offset") or 0)
        info = out.get(jid)
        if info is None:
            info = out[jid] = JobInfo(
                job_id=jid,
                slurm_state=_state(j.get("job_state")),
                reason=j.get("state_reason") if j.get("state_reason") not in ("None", "") else None,
                exit_code=_exit(j.get("exit_code")),
                start_time=j.get("start_time") or None,
                end_time=j.get("end_time") or None,
            )
        info.components[offset] = nodes
        info.nodes += [n for n in nodes if n not in info.nodes]
    return out


def _state(value) -> str:
    if isinstance(value, list):  # newer squeue: a list of flags, the base state first
        value = value[0] if value else ""
    return str(value or "")


def _exit(value) -> int | None:
    """squeue's exit_code: a wait status (22.05) or {"return_code": {...}, "signal": ...}."""
    if isinstance(value, dict):
        rc = value.get("return_code")
        rc = rc.get("number") if isinstance(rc, dict) else rc
        sig = value.get("signal", {})
        sig = sig.get("id", {}).get("number") if isinstance(sig, dict) else sig
        return 128 + int(sig) if sig else (int(rc) if rc is not None else None)
    if value is None:
        return None
    status = int(value)
    return 128 + (status & 0x7F) if status & 0x7F else status >> 8


def scancel(job_id: str) -> None:
    res = run(["scancel", job_id])
    if res.returncode != 0 and "already completing or completed" not in res.stderr.lower():
        if "invalid job id" in res.stderr.lower():
            return  # gone from the controller already
        message = slurm_message(res.stderr)
        if _NO_ANSWER.search(message):
            raise _unreachable(f"scancel {job_id}", message)
        raise LaunchError(f"scancel {job_id} failed: {message}")


def known(job_id: str) -> bool:
    """Whether the controller still knows this job: False only when it says so (it forgets an
    ended job after MinJobAge); raises Unreachable when it does not answer."""
    res = run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i"])
    if res.returncode == 0:
        return bool(res.stdout.strip())
    message = slurm_message(res.stderr)
    if "invalid job id" in message.lower():
        return False
    if _NO_ANSWER.search(message):
        raise _unreachable("squeue", message)
    raise LaunchError(f"squeue -j {job_id} failed: {message}")


def expand(nodelist: str) -> list[str]:
    """n[1-3],m5 -> [n1, n2, n3, m5], without asking scontrol for the simple cases."""
    if not nodelist:
        return []
    if "[" not in nodelist:
        return [n for n in nodelist.split(",") if n]
    res = run(["scontrol", "show", "hostnames", nodelist])
    return res.stdout.split() if res.returncode == 0 else [nodelist]


@dataclass
class Partition:
    name: str
    nodes: list[str]
    gpus_per_node: int  # the smallest count among its nodes (0: no GPUs)
    cpus_per_node: int
    default: bool = False
    state: str = "up"


def partitions() -> list[Partition]:
    res = run(["sinfo", "-h", "-N", "-o", "%N|%P|%G|%c|%a"])
    if res.returncode != 0:
        if _NO_ANSWER.search(res.stderr):
            raise _unreachable("sinfo", slurm_message(res.stderr))
        raise LaunchError(
            f"sinfo failed: {slurm_message(res.stderr)}", hint="is slurmctld up? `scontrol ping`"
        )
    found: dict[str, Partition] = {}
    for line in res.stdout.splitlines():
        try:
            node, name, gres, cpus, avail = line.split("|")
        except ValueError:
            continue
        default = name.endswith("*")
        name = name.rstrip("*")
        gpus = gpu_count(gres)
        p = found.get(name)
        if p is None:
            p = found[name] = Partition(name, [], gpus, int(cpus or 0), default, avail)
        if node not in p.nodes:
            p.nodes.append(node)
        p.gpus_per_node = min(p.gpus_per_node, gpus)
        p.cpus_per_node = min(p.cpus_per_node, int(cpus or 0))
    return list(found.values())


def partition(name: str | None) -> Partition | None:
    """The partition a job lands in (the cluster's default when `name` is None), or None when
    sinfo does not know it (sbatch then refuses it with Slurm's words)."""
    for p in partitions():
        if (name is None and p.default) or p.name == name:
            return p
    return None


def gpu_count(gres: str) -> int:
    """GPUs in a gres string: "gpu:4", "gpu:a100:8(S:0-1)", "gpu:2,shard:8"."""
    total = 0
    for part in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", part.strip())
        if m:
            total += int(m.group(1))
    return total


def version() -> str | None:
    res = run(["sinfo", "--version"])
    return res.stdout.strip() or None if res.returncode == 0 else None


def het_groups(job_id: str) -> dict[str, int]:
    """node → its component, for a heterogeneous job (srun reaches it with --het-group)."""
    try:
        info = jobs([job_id]).get(job_id)
    except ArealError:
        return {}
    if info is None or len(info.components) < 2:
        return {}
    return {n: offset for offset, names in info.components.items() for n in names}


def down_nodes(nodes: list[str]) -> list[str]:
    """Which of these nodes Slurm considers down, drained or failed now."""
    if not nodes:
        return []
    res = run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%T"])
    out = []
    for line in res.stdout.splitlines():
        node, _, state = line.partition("|")
        if re.match(r"(down|drain|fail|not_responding|unknown)", state.lower()) or state.endswith(
            "*"
        ):
            out.append(node)
    return sorted(set(out))


def run_on_nodes(
    job_id: str, commands: dict[str, list[str]], timeout: float
) -> dict[str, tuple[str | None, str | None]]:
    """node → (stdout, why not) of a short command run on each node of the job at once,
    each by `srun --overlap` into the job (its het group for a heterogeneous job)."""
    groups = het_groups(job_id)

    def one(node: str) -> tuple[str | None, str | None]:
        # The node's name in areal's terms, as its steps have it (slurm/step.py).
        argv = ["srun", "--overlap", f"--jobid={job_id}", "-w", node, "--nodes=1",
                "--ntasks=1", "--quiet", f"--export=ALL,AREAL_NODE_NAME={node}",
                *commands[node]]  # fmt: skip
        if node in groups:
            argv.insert(3, f"--het-group={groups[node]}")
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                 check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return None, f"no answer from node {node} within {timeout:g}s"
        except OSError as e:
            return None, f"cannot run srun: {e}"
        if res.stdout.strip():
            return res.stdout, None
        why = slurm_message(res.stderr) if res.stderr.strip() else f"srun exited {res.returncode}"
        return None, f"node {node} cannot be reached: {why}"

    with ThreadPoolExecutor(max_workers=max(1, len(commands))) as ex:
        return dict(zip(commands, ex.map(one, commands), strict=True))
