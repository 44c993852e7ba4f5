"""One job on a Ray cluster, from `areal`'s side: start its actors (and the training nodes'
placement group), watch its servers register, follow it to its end, tell why it ended, and
leave nothing behind: no actor, no placement group, no process, no registry entry.

Every actor and the group are detached (lifetime="detached"): a group made by a driver that
exits is removed with its actors, and `serve --detach` outlives its `areal`. They are named
by the job's marker in namespace `areal`, so any later `areal` finds them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from areal_cli import schedulers
from areal_cli.diagnose import restart
from areal_cli.errors import LaunchError, WaitTimeout
from areal_cli.schedulers import lifecycle
from areal_cli.schedulers.api import LIVE, Stopped
from areal_cli.schedulers.cluster import (
    SlotLock,
    clash,
    drop_old_runs,
    new_run_folder,
    ready_addr,
    record_fields,
    refusal,
    reread,
)

# The name this module's watch calls it by.
from areal_cli.schedulers.cluster import read_code as _read_code
from areal_cli.schedulers.cluster_live import deregister_servers, leave_nothing
from areal_cli.schedulers.common import describe_exit, tail_text
from areal_cli.schedulers.ray import actor, cluster, records, watch
from areal_cli.schedulers.ray.planner import (
    PLAN_FILE,
    TRAINER_ENV_FILE,
    RayPlan,
    actor_name,
    group_name,
)
from areal_cli.schedulers.ray.records import RayRecord

POLL = 0.2
# Seconds a restart waits for the other training nodes' torchrun to end by themselves.
PEERS_END = 30.0
STOPPED_BY_AREAL = "stopped by areal stop"
KILLED_BY_RAY = "killed from Ray's side"
EventFn = Callable[[str, dict], None]


# -- starting --------------------------------------------------------------------------------


def submit(plan: RayPlan, home: Path, world_size: int) -> RayRecord:
    """The run folder (private plan, the trainers' environment), the record, then the actors
    and group, asked of Ray (placed later). One live job per slot."""
    with _slot_lock(home, plan):
        refuse_if_running(home, plan)
        previous = records.load(home, plan.experiment, plan.trial, plan.kind)
        new_run_folder(plan, PLAN_FILE, TRAINER_ENV_FILE)
        rec = RayRecord(
            **record_fields(plan, world_size), job_id=plan.job_id, address=plan.address,
            actors=plan.actor_names(), group=group_name(plan.marker) if plan.trainers else None,
        )  # fmt: skip
        records.write(home, rec)
    drop_old_runs(previous, rec)
    return rec


def _slot_lock(home: Path, plan: RayPlan) -> SlotLock:
    return SlotLock(records.trial_dir(home, plan.experiment, plan.trial), plan, "started")


def refuse_if_running(home: Path, plan: RayPlan) -> None:
    """A serving and a training job may share E/T; a second of the same kind may not, on any
    scheduler."""
    for sched, h in schedulers.known_jobs(plan.experiment, plan.trial, home=home):
        job = sched.describe(h)
        if job is None or job.state not in LIVE:
            continue
        if clash(plan, h.kind):
            raise refusal(plan, h.kind, str(h))


def _step_class():
    import ray

    return ray.remote(actor.Step)


def create(plan: RayPlan, env: dict[str, str]) -> tuple[dict, object | None]:
    """label → actor handle, and the placement group: asked of Ray, placed when it can.
    A server's actor starts its runner once placed; the trainers' wait for the endpoint."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    step = _step_class()
    actors: dict = {}
    common = {"namespace": cluster.NAMESPACE, "lifetime": "detached", "max_restarts": 0,
              "max_concurrency": 8}  # fmt: skip
    for s in plan.servers:
        label = f"server-{s.index}"
        actors[label] = step.options(
            name=actor_name(plan.marker, label),
            num_cpus=s.resources.get("CPU", 0.0), num_gpus=s.resources.get("GPU", 0.0),
            **common,
        ).remote(label, plan.run_dir, plan.marker, 0, runner_argv(plan, label, None), env)  # fmt: skip
    pg = None
    for t in plan.trainers:
        pg = placement_group(
            [dict(t.resources) for _ in range(t.nodes)], strategy=plan.strategy,
            name=group_name(plan.marker), lifetime="detached",
        )  # fmt: skip
        for k in range(t.nodes):
            label = f"torchrun-{k}"
            actors[label] = step.options(
                name=actor_name(plan.marker, label),
                num_cpus=t.resources.get("CPU", 0.0), num_gpus=t.resources.get("GPU", 0.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=k
                ),
                **common,
            ).remote(label, plan.run_dir, plan.marker, k)  # fmt: skip
    return actors, pg


def runner_argv(plan: RayPlan, label: str, endpoint: str | None) -> list[str]:
    run = Path(plan.run_dir)
    if label.startswith("server-"):
        index = label.split("-", 1)[1]
        return ["{python}", "-m", "areal_cli.launchers.replica", str(run / PLAN_FILE),
                "--index", index]  # fmt: skip
    t = plan.trainers[0]
    argv = [a.replace("{rdzv_endpoint}", endpoint or "") for a in t.argv]
    return [
        "{python}", "-m", "areal_cli.launchers.torchrun", "--log-dir", plan.log_dir,
        "--own-log", "torchrun-{node}.log", "--env-file", str(run / TRAINER_ENV_FILE), "--",
        *argv,
    ]  # fmt: skip


# What of the submitting shell's environment reaches the job's processes (Ray starts them in
# the node's environment): areal's own settings, the hub's, torch's, NCCL's and the engines'.
# Never an API key (the job's key reaches its processes its own way), never Ray's auth.
FORWARD_PREFIXES = ("AREAL_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "NCCL_", "TORCH_",
                    "GLOO_", "SGLANG_", "VLLM_")  # fmt: skip
NOT_FORWARDED = ("AREAL_JOB_MARKER", "AREAL_NODE_NAME", "AREAL_NODE_ADDR", "AREAL_NODE_INDEX",
                 "AREAL_SCHEDULER_NAME", "AREAL_SCHEDULER_JOB_ID")  # fmt: skip


def forwarded_env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items()
        if k.startswith(FORWARD_PREFIXES) and k not in NOT_FORWARDED
        and not k.endswith("API_KEY")
    }  # fmt: skip


# -- what Ray says -------------------------------------------------------------------------


def exit_codes(rec: RayRecord) -> dict[str, int]:
    """label → the runner's exit code, for the runners that ended."""
    out = {}
    for name in rec.actors:
        label = name.rsplit("/", 1)[1]
        code = _read_code(Path(rec.run_dir) / f"{label}.exit")
        if code is not None:
            out[label] = code
    return out


def dead_actors(rec: RayRecord) -> dict[str, str]:
    """label → why Ray says its actor died, for the job's actors that are gone (not one
    areal ended: those are recorded as stopped first)."""
    states = cluster.actor_states(rec.actors)
    out = {}
    for name in rec.actors:
        st = states.get(name)
        label = name.rsplit("/", 1)[1]
        if st is None:
            if rec.state != "pending":
                out[label] = "no longer known to the Ray cluster"
        elif st.state == "DEAD":
            out[label] = st.death or "dead"
    return out


def refresh(recs: list[RayRecord], home: Path) -> None:
    """Bring live records up to date with the cluster (one call for all); a job whose actors
    are all gone, or whose runners all ended, is finished. A cluster that does not answer
    raises cluster.Unreachable before anything is written, removed or killed."""
    reread(recs, records, home)
    live = [r for r in recs if r.live]
    if not live:
        return
    cluster.connect(live[0].address)
    for rec in live:
        if rec.state == "stopping":
            continue  # another areal is ending it
        dead = dead_actors(rec)
        codes = exit_codes(rec)
        labels_ = [n.rsplit("/", 1)[1] for n in rec.actors]
        # A Step outlives its runner: an actor that died was killed (areal's own stops
        # record "stopping" first), whatever exit code its runner's end left behind.
        killed = dict(dead)
        if killed:
            rec.reason = "; ".join(f"{lb}: {why}" for lb, why in sorted(killed.items()))
        if killed and (rec.kind != "serve" or len(killed) == len(labels_)):
            rec.state, rec.message = "killed", f"{KILLED_BY_RAY}: {rec.reason}"
            rec.reason = rec.message
            teardown(rec, home, grace=2.0)
            finish(rec, home)
        elif len(codes) == len(labels_) or (
            rec.kind != "serve"
            and any(lb.startswith("torchrun") for lb in codes)
            and all(codes.get(lb) == 0 for lb in labels_ if lb.startswith("torchrun"))
        ):
            bad = {lb: c for lb, c in codes.items() if c}
            rec.state = "failed" if bad else "stopped"
            rec.exit_code = next(iter(bad.values()), 0)
            rec.message = rec.message or (
                "; ".join(f"{lb} ended ({describe_exit(c)})" for lb, c in bad.items()) or "ended"
            )
            _failed_by_watchdog(rec)
            teardown(rec, home, grace=2.0)
            finish(rec, home)
        else:
            for lb in killed:
                if lb.startswith("server-"):
                    reap_replica(rec, int(lb.split("-")[1]))
            records.write(home, rec)


def _failed_by_watchdog(rec: RayRecord) -> dict | None:
    """--watchdog-action fail ended the job: that stall is why, not torchrun's exit code."""
    stalled = lifecycle.failed_by_watchdog(rec.run_dir) if rec.kind != "serve" else None
    if stalled is not None:
        rec.state, rec.exit_code = "failed", 1
        rec.message = f"watchdog: {lifecycle.headline(stalled)}"
    return stalled


def reap_replica(rec: RayRecord, index: int) -> None:
    """A replica whose actor Ray killed: its server (the actor's grandchild) still runs and
    is still registered. Out of discovery, and ended on its node."""
    addr = ready_addr(rec, index)
    if addr:
        deregister_servers(rec, {addr})
    node = rec.node_ids.get(f"server-{index}")
    if node:
        _on_nodes([node], "sweep", rec.marker, index)


def _on_nodes(node_ids: list[str], what: str, *args, timeout: float = 30.0) -> dict[str, object]:
    """Run actor.<what>(*args) as a task on each node (node affinity, no resources held)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = {n.node_id for n in cluster.nodes()}
    fn = ray.remote(num_cpus=0, max_retries=0)(getattr(actor, what))
    refs = {
        nid: fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(
            *args
        )
        for nid in dict.fromkeys(node_ids)
        if nid in alive
    }
    out: dict[str, object] = {}
    ready, _ = cluster.wait_refs(list(refs.values()), timeout)
    for nid, ref in refs.items():
        if ref in ready:
            try:
                out[nid] = ray.get(ref)
            except Exception as e:
                out[nid] = e
    return out


def teardown(rec: RayRecord, home: Path, grace: float = 10.0) -> int:
    """Every actor asked to stop its runner (SIGTERM, SIGKILL after `grace`), then killed,
    the group removed, and what is left of the job on each of its nodes ended by its marker
    (an actor's grandchildren outlive it). Returns the actors that were alive."""
    import ray

    handles, gone = {}, []
    for name in rec.actors:
        try:
            handles[name] = ray.get_actor(name, namespace=cluster.NAMESPACE)
        except ValueError:
            gone.append(name)  # dead, or never created
    # Each live actor ends what the job left on its node; where one is gone (killed from
    # Ray's side), a task on that node does.
    # One never placed runs nothing (and would answer only once placed): killed alone.
    placed = {n for n in handles if n.rsplit("/", 1)[1] in rec.node_ids}
    refs = {name: h.stop.remote(grace) for name, h in handles.items() if name in placed}
    done, _ = cluster.wait_refs(list(refs.values()), grace + 10.0) if refs else ([], [])
    for name, h in handles.items():
        if name in refs and refs[name] not in done:
            gone.append(name)
        try:
            ray.kill(h, no_restart=True)
        except Exception:
            pass
    if rec.group:
        try:
            from ray.util import get_placement_group, remove_placement_group

            remove_placement_group(get_placement_group(rec.group))
        except (ValueError, Exception):
            pass
    # An actor never placed ran nothing; one placed has its node in the record.
    swept = {rec.node_ids.get(n.rsplit("/", 1)[1]) for n in refs if n not in gone}
    left = {rec.node_ids.get(n.rsplit("/", 1)[1]) for n in gone} - swept - {None}
    if left:
        _on_nodes(sorted(left), "sweep", rec.marker)
    return len(handles)


def finish(rec: RayRecord, home: Path) -> int:
    """The job has ended: nothing of it in discovery or on this host; the record says how.
    Returns the registry entries removed."""
    return leave_nothing(rec, home, records, PLAN_FILE)


def cancel(rec: RayRecord, home: Path, timeout: float, reason: str) -> None:
    rec.state, rec.message = "stopping", reason
    records.write(home, rec)
    cluster.connect(rec.address)
    teardown(rec, home, grace=max(1.0, min(timeout, 30.0) - 2.0))
    rec.state = "stopped"


# -- watching one job from `areal` -----------------------------------------------------------


def follow(plan: RayPlan, rec: RayRecord, home: Path, stop: threading.Event,
           on_event: EventFn | None = None, on_line=None, on_progress=None) -> lifecycle.Lifecycle:  # fmt: skip
    """The job's lifecycle over Ray: placed → started → servers registered → its end."""
    return lifecycle.Lifecycle(Transport(plan, rec, home), stop, on_event, on_line, on_progress)


class Transport(lifecycle.Transport):
    """Detached actors placed by Ray (the trainers in one placement group), each running one
    runner; its trainers restarted by this areal in the same actors; ended by teardown."""

    plan: RayPlan
    rec: RayRecord
    records = records
    poll_every = 0.3

    def __init__(self, plan: RayPlan, rec: RayRecord, home: Path):
        super().__init__(plan, rec, home)
        self.actors: dict = {}
        self.group = None
        self.where: dict[str, dict] = {}
        self._checked = 0.0

    @property
    def what(self) -> str:
        return f"Ray job {self.rec.job_id}"

    @property
    def trainers(self) -> list[str]:
        return [lb for lb in self.actors if lb.startswith("torchrun-")]

    def place(self) -> None:
        """The actors asked of Ray and placed, the trainers started (and the job's watchdog
        beside them)."""
        deadline = time.monotonic() + self.plan.health_timeout
        env = {**forwarded_env(), "AREAL_HOME": self.plan.home}
        self.actors, self.group = create(self.plan, env)
        self._placed(deadline)
        self._start(env)
        self.rec.state = "starting" if self.plan.servers else "running"
        records.write(self.home, self.rec)
        nodes = sorted({w["ip"] for w in self.where.values()})
        self.life.on_event("submitted", {"what": f"Ray job {self.rec.job_id} on "
                                         f"{', '.join(nodes)}", "job_id": self.rec.job_id})  # fmt: skip

    def _start(self, env: dict[str, str]) -> None:
        """Every training node's torchrun (the rendezvous on the first node's endpoint), and
        the job's watchdog in the first node's actor."""
        import ray

        trainers = self.trainers
        endpoint = None
        if len(trainers) > 1:
            endpoint = ray.get(self.actors["torchrun-0"].endpoint.remote(), timeout=30)
        starts = [self.actors[lb].start.remote(runner_argv(self.plan, lb, endpoint), env)
                  for lb in trainers]  # fmt: skip
        ray.get(starts, timeout=60)
        if trainers and self.plan.watchdog > 0:
            # In the job, not in this areal: a detached or orphaned job is watched too.
            ray.get(self.actors["torchrun-0"].watch.remote(len(trainers)), timeout=60)

    def _placed(self, deadline: float) -> None:
        """Until Ray placed every actor (the group first: all its bundles or none). What it
        cannot place within the health timeout is named, with what each node has free, and
        the job removed: exit 3."""
        import ray

        pending = {lb: a.where.remote() for lb, a in self.actors.items()}
        group_ready = self.group.ready() if self.group is not None else None
        while pending:
            self.life.check_stop()
            refs = list(pending.values()) + ([group_ready] if group_ready is not None else [])
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.2)
            for lb, ref in list(pending.items()):
                if ref in done:
                    self._landed(lb, ref)
                    del pending[lb]
            if group_ready is not None and group_ready in done:
                group_ready = None
            if not pending:
                break
            waiting = sorted(pending)
            self.life.on_progress(f"Ray job {self.rec.job_id}: waiting for resources for "
                                  f"{', '.join(waiting)}")  # fmt: skip
            if time.monotonic() > deadline:
                self._not_placed(pending, group_ready is not None)
        records.write(self.home, self.rec)

    def _landed(self, label: str, ref) -> None:
        import ray

        try:
            self.where[label] = ray.get(ref)
        except Exception as e:
            self.cancel("an actor failed to start")
            raise LaunchError(f"{label}'s actor failed on the Ray cluster: {e}") from None
        self.rec.node_ids[label] = self.where[label]["node_id"]
        self.rec.nodes = sorted({w["ip"] for w in self.where.values()})

    def _not_placed(self, pending: dict, group: bool) -> None:
        free = "; ".join(n.describe() for n in cluster.nodes())
        need = []
        if group:
            t = self.plan.trainers[0]
            need.append(f"the training placement group ({t.nodes} bundle(s) of "
                        f"{cluster.words(t.resources)}, {self.plan.strategy})")  # fmt: skip
        need += [f"{lb} ({cluster.words(s.resources)})" for s in self.plan.servers
                 if (lb := f"server-{s.index}") in pending]  # fmt: skip
        self.cancel("not placed in time")
        raise WaitTimeout(
            f"Ray could not place {' and '.join(need)} within "
            f"{self.plan.health_timeout:g}s; free now: {free}",
            hint="other jobs hold what it needs (`ray status`); stop them, ask for "
            "less, or raise --health-timeout",
        )

    def look_starting(self) -> None:
        self._check_actors()

    def look(self) -> int | None:
        self._check_actors()
        trainers = self.trainers
        if not trainers:
            return None
        codes = {lb: self.exit_code(lb) for lb in trainers}
        bad = {lb: c for lb, c in codes.items() if c}
        if bad and self.life.restart(next(iter(bad.values()))):
            return None
        if bad or all(c == 0 for c in codes.values()):
            return self._trainers_ended(codes)
        return None

    def servers_gone(self) -> None:
        self._end("every server exited")
        p = self.plan.servers[0]
        raise LaunchError(
            "every server exited (no replica left)",
            detail=tail_text(p.log_path),
            hint=f"full log: {p.log_path}",
        )

    # -- restarts -------------------------------------------------------------------------

    def stop_trainers(self) -> None:
        """The other nodes' torchrun end by themselves once their peers are gone, each with
        its report (the failed rank's may be there only): wait for them a while, then stop
        what is left. The servers of a combined job stay."""
        trainers = self.trainers
        deadline = time.monotonic() + PEERS_END
        stop = self.life.stop
        while any(self.exit_code(lb) is None for lb in trainers) and not stop.is_set():
            if time.monotonic() > deadline:
                break
            stop.wait(0.1)
        watch.stop_trainers(self.plan.marker, len(trainers))

    def start_trainers(self, attempt: int) -> None:
        """torchrun again in the same actors, so in the same placement group."""
        for lb in self.trainers:
            (self.run / f"{lb}.exit").unlink(missing_ok=True)
        env = {**forwarded_env(), "AREAL_HOME": self.plan.home}
        env[restart.ENV] = str(attempt)
        self._start(env)

    def _check_actors(self) -> None:
        """An actor that died was killed from Ray's side (`ray kill`, its node lost; a Step
        outlives its runner): the job ends, saying so."""
        if time.monotonic() - self._checked < 1.0:
            return
        self._checked = time.monotonic()
        dead = dead_actors(self.rec)
        if not dead:
            return
        self.life.check_stop()  # an `areal stop` elsewhere kills actors too: that is no fault
        what = "; ".join(f"{lb} on {self.where.get(lb, {}).get('ip', '?')}: {why}"
                         for lb, why in sorted(dead.items()))  # fmt: skip
        self.rec.state, self.rec.message = "killed", f"{KILLED_BY_RAY}: {what}"
        self.life.close()
        teardown(self.rec, self.home, grace=2.0)
        finish(self.rec, self.home)
        raise LaunchError(f"Ray job {self.rec.job_id}: actor {what} ({KILLED_BY_RAY})",
                          hint=f"`areal logs {self.rec.name}` shows how far it got")  # fmt: skip

    def check_stop(self) -> None:
        on_disk = records.read(records.path(self.home, self.rec.experiment, self.rec.trial,
                                            self.rec.kind))  # fmt: skip
        if (
            on_disk is not None
            and on_disk.job_id == self.rec.job_id
            and on_disk.state in ("stopping", "stopped")
            and on_disk.message == STOPPED_BY_AREAL
        ):
            # `areal stop` from elsewhere: it tears the job down; this areal reports it.
            self.life.close()
            for name, value in on_disk.to_json().items():
                setattr(self.rec, name, value)
            self.life.on_event("stopping", {"state": "stopped"})
            raise Stopped(143)

    def cancel(self, reason: str) -> None:
        self.life.close()
        cancel(self.rec, self.home, 30.0, reason)
        finish(self.rec, self.home)

    def _end(self, why: str) -> None:
        self.life.close()
        self.rec.state, self.rec.message = "failed", why
        teardown(self.rec, self.home, grace=5.0)
        finish(self.rec, self.home)

    def _trainers_ended(self, codes: dict[str, int | None]) -> int:
        bad = {lb: c for lb, c in codes.items() if c}
        # One node's torchrun failing ends the others (root cause first, no silent hang).
        self.life.close()
        self.rec.state = "failed" if bad else "stopped"
        self.rec.exit_code = next(iter(bad.values()), 0)
        code = self.rec.exit_code
        try:
            teardown(self.rec, self.home, grace=5.0)
            stalled = _failed_by_watchdog(self.rec) if bad else None
            if stalled is not None:
                self.life.on_event("trainer_exit", {"label": "torchrun", "code": 1})
                raise lifecycle.watchdog_failure(stalled, self.rec.message)
            self.life.on_event("trainer_exit", {"label": "torchrun", "code": code})
            if not bad:
                self.rec.message = "ended"
                return 0
            err = self._trainer_failure(code)
            self.rec.message, self.rec.detail = err.message, err.detail
            raise err
        finally:
            finish(self.rec, self.home)

    def _trainer_failure(self, code: int) -> LaunchError:
        # The node a rank ran on is in its report (each node's torchrun log).
        return lifecycle.trainer_failure(
            self.plan.log_dir, code, str(self.run / "torchrun-0.out"), lambda rank: None
        )
