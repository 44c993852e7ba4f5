"""The watchdog of a Ray training job (`--watchdog SECONDS`). It runs in a thread of the first
training node's actor (torchrun-0), beside that node's torchrun, so a detached job is watched
as a foreground one, as on Slurm (where it runs in the batch job), and it ends with the job's
actors.

Every look runs `python -m areal_cli.diagnose.watchdog --marker M` in the job's actor on each
training node at once (diagnose.watchdog.watch_nodes through run_by_actors below, the reach
`areal doctor` uses; in the actor's own process, actor.run_module): the ranks' doctor
channels are Unix sockets, readable on their own node only. On a stall the hang doctor samples
every node the same way; the verdict goes to watchdog.log (`areal logs`), the bundle in the log
folder and `$RUN/watchdog.json`, which `areal ps` reads. With `--watchdog-action fail` it then
stops every node's torchrun and leaves `$RUN/watchdog.fail`: the job ends failed (exit 1),
the verdict its message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from areal_cli import request_errors
from areal_cli.diagnose import watchdog
from areal_cli.errors import ArealError
from areal_cli.files import write_atomic
from areal_cli.schedulers.cluster_live import servers_by_node

# The run folder's stall files are the same on every cluster scheduler.
from areal_cli.schedulers.lifecycle import (
    FAIL_FILE,
    STALL_FILE,
    failed_by_watchdog,
    headline,
    read_stall,
)
from areal_cli.schedulers.ray import cluster
from areal_cli.schedulers.ray.planner import PLAN_FILE, RayPlan, actor_name

__all__ = ["FAIL_FILE", "STALL_FILE", "failed_by_watchdog", "headline", "read_stall", "start",
           "run_by_actors", "stop_trainers"]  # fmt: skip


def start(run_dir: str, stop_trainers: Callable[[], None]):
    """The job's watchdog, started (a diagnose.watchdog.Watchdog), or None when the job has
    none. `stop_trainers` ends every training node's torchrun (--watchdog-action fail)."""
    run = Path(run_dir)
    plan = RayPlan.from_json(json.loads((run / PLAN_FILE).read_text()))
    if plan.watchdog <= 0 or not plan.trainers:
        return None
    trainers = [actor_name(plan.marker, f"torchrun-{k}") for k in range(plan.trainers[0].nodes)]
    known: list[str] = []

    def nodes() -> list[str]:
        """The training nodes, once every training actor is placed (they do not move)."""
        if not known:
            try:
                states = cluster.actor_states(trainers)
            except Exception:  # the GCS is slow: next look
                return []
            ips = [st.node_ip for n in trainers if (st := states.get(n)) and st.node_ip]
            if len(ips) == len(trainers):
                known.extend(dict.fromkeys(ips))
        return known

    def reach(job_id: str, commands: dict[str, list[str]], timeout: float) -> dict:
        return run_by_actors(plan.actor_names(), job_id, commands, timeout)

    def on_stall(stall: watchdog.Stall) -> None:
        watchdog.log_line(plan.log_dir, stall, plan.watchdog)
        state = {**stall.to_json(), "seconds": plan.watchdog, "action": plan.watchdog_action}
        try:
            write_atomic(run / STALL_FILE, json.dumps(state, indent=2))
        except (OSError, ArealError):
            pass  # a full disk: the stall is still acted on (and in the watchdog's line)
        if plan.watchdog_action == "fail":
            try:
                write_atomic(run / FAIL_FILE, stall.headline())
            except (OSError, ArealError):
                pass  # the trainers are stopped all the same
            stop_trainers()

    return watchdog.watch_nodes(
        plan.watchdog, plan.log_dir, job_id=plan.job_id, nodes=nodes, marker=plan.marker,
        reach=reach, label=f"job {plan.experiment}/{plan.trial} (Ray job {plan.job_id})",
        on_stall=on_stall, servers=lambda: servers_by_node(plan),
        refused=request_errors.of_trial(plan.registry, plan.experiment, plan.trial),
        auto=plan.watchdog_auto,
    )  # fmt: skip


def stop_trainers(marker: str, nodes: int, grace: float = 10.0) -> None:
    """SIGTERM every training node's torchrun through its actor (each tears its ranks down),
    SIGKILL after `grace`; the servers of a combined job are left to the teardown."""
    import ray

    refs = []
    for k in range(nodes):
        try:
            actor = ray.get_actor(actor_name(marker, f"torchrun-{k}"), namespace=cluster.NAMESPACE)
        except ValueError:
            continue
        refs.append(actor.stop.remote(grace, False))
    if refs:
        cluster.wait_refs(refs, grace + 10.0)


def run_by_actors(
    actors: list[str], job_id: str, commands: dict[str, list[str]], timeout: float
) -> dict[str, tuple[str | None, str | None]]:
    """node → (stdout, why not) of each node's command, run by a live actor of the job on that
    node (Step.run), all at once; from a driver (`areal doctor`) or from inside the job (its
    watchdog, in an actor)."""
    import ray

    by_ip: dict[str, str] = {}
    for name, st in cluster.actor_states(actors).items():
        if st.state == "ALIVE" and st.node_ip:
            by_ip.setdefault(st.node_ip, name)
    out: dict[str, tuple[str | None, str | None]] = {}
    refs = {}
    for node, argv in commands.items():
        name = by_ip.get(node)
        if name is None:
            out[node] = (None, f"node {node} cannot be reached: no live actor of Ray job "
                               f"{job_id} there")  # fmt: skip
            continue
        try:
            actor = ray.get_actor(name, namespace=cluster.NAMESPACE)
        except ValueError:
            out[node] = (None, f"node {node} cannot be reached: its actor {name} is gone")
            continue
        refs[node] = actor.run.remote(argv, timeout)
    ready, _ = cluster.wait_refs(list(refs.values()), timeout + 10.0)
    for node, ref in refs.items():
        if ref not in ready:
            out[node] = (None, f"no answer from node {node} within {timeout + 10:g}s")
            continue
        try:
            code, stdout, stderr = ray.get(ref)
        except Exception as e:
            out[node] = (None, f"node {node} cannot be reached: {type(e).__name__}: {e}")
            continue
        if stdout.strip():
            out[node] = (stdout, None)
        else:
            last = (stderr.strip().splitlines() or [f"exit code {code}"])[-1]
            out[node] = (None, f"node {node}: the command failed: {last}")
    return out
