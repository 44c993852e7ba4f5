"""Talking to a Ray cluster: connect as a driver, its nodes and what they hold, its actors'
states. Only this module and the actor module import `ray`.

Where the cluster is: the scheduler option `address`, else RAY_ADDRESS (Ray's own
convention). areal never starts a cluster of its own: with neither given it refuses (exit 2)
instead of letting `ray.init()` start a local one.

Auth is Ray's: a cluster with token authentication (RAY_AUTH_MODE=token) wants the token in
RAY_AUTH_TOKEN or in the file RAY_AUTH_TOKEN_PATH names (default ~/.ray/auth_token), set by
the user for areal as for any Ray client. areal never takes the token on its command line,
never writes one, and says so when the cluster refuses it.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field

from areal_cli.errors import UsageError, WaitTimeout

NAMESPACE = "areal"
CONNECT_TIMEOUT = float(os.environ.get("AREAL_RAY_TIMEOUT", "15"))

_lock = threading.Lock()
_connected: str | None = None
_saved_stderr: int | None = None  # fd 2 while the preflight silences Ray's C++ client


class Unreachable(WaitTimeout):
    """The cluster did not answer: nothing can be concluded about any job (exit 3)."""


def address(option: str | None = None) -> str:
    addr = option or os.environ.get("RAY_ADDRESS")
    if not addr:
        raise UsageError(
            "no Ray cluster given",
            hint="set RAY_ADDRESS=HEAD:PORT (Ray's own variable; the head's GCS port, 6379 by "
            "default) or --scheduler-opt address=HEAD:PORT",
        )
    return addr


def connect(option: str | None = None) -> str:
    """Connect this process to the cluster once (a driver in namespace `areal`)."""
    global _connected
    addr = address(option)
    _check_token_file()
    with _lock:
        if _connected is not None:
            return _connected
        try:
            import ray
        except ImportError:
            raise UsageError(
                "the Ray scheduler needs Ray in this interpreter",
                hint="pip install 'areal-cli[ray]' (the cluster's Ray version)",
            ) from None
        # Ray logs to the root logger and stderr on its own; areal's commands print.
        logging.getLogger("ray").setLevel(logging.ERROR)
        done: list[BaseException | None] = []

        def init() -> None:
            try:
                _preflight(addr)
                ray.init(
                    address=addr, namespace=NAMESPACE, logging_level=logging.ERROR,
                    log_to_driver=False,
                )  # fmt: skip
                done.append(None)
            except BaseException as e:
                done.append(e)

        t = threading.Thread(target=init, daemon=True)
        t.start()
        t.join(CONNECT_TIMEOUT)
        if not done:
            _restore_stderr()
            raise Unreachable(
                f"the Ray cluster at {addr} did not answer within {CONNECT_TIMEOUT:g}s",
                hint="is the head up (`ray status --address ADDR`)? AREAL_RAY_TIMEOUT sets "
                "the wait",
            )
        if done[0] is not None:
            raise _connect_error(addr, done[0]) from None
        _connected = addr
        # Runs before Ray's own exit hook (registered when ray was imported): that one
        # sleeps 0.5 s first for a driver's worker logs to print, and areal takes none.
        atexit.register(disconnect)
        return addr


def _check_token_file() -> None:
    """A token file Ray cannot read is refused here: Ray's C++ client aborts the whole process
    on it during the preflight, while fd 2 points at /dev/null (exit 1, no word said)."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not path or os.environ.get("RAY_AUTH_TOKEN"):
        return  # Ray reads RAY_AUTH_TOKEN first, the file only without it
    full = os.path.expanduser(path)
    why = None
    if not os.path.exists(full):
        why = "does not exist"
    elif not os.path.isfile(full):
        why = "is not a file"
    elif not os.access(full, os.R_OK):
        why = "is not readable by this user"
    if why:
        raise UsageError(
            f"RAY_AUTH_TOKEN_PATH={path}: the token file {why}",
            hint="point RAY_AUTH_TOKEN_PATH at the file holding the cluster's token (`ray "
            "get-auth-token` on the head prints it), or unset it",
        )


def disconnect() -> None:
    """Leave the cluster (idempotent): the driver's objects and leases go with it."""
    import ray

    try:
        ray.shutdown()
    except Exception:
        pass


def _preflight(addr: str) -> None:
    """Ask the GCS once before ray.init: a token it refuses is an AuthenticationError now,
    where ray.init would retry for its whole timeout, logging each refusal to stderr."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or "://" in addr:
        return  # "auto", ray://: ray.init resolves those itself
    from ray._raylet import GcsClient

    global _saved_stderr
    saved = _saved_stderr = os.dup(2)
    try:
        # Ray's C++ client logs the refusal on fd 2 itself: the message here says it once.
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            GcsClient(address=addr)
    finally:
        _restore_stderr()
        os.close(saved)


def _restore_stderr() -> None:
    """fd 2 back, also when the connect gave up on a preflight still waiting."""
    global _saved_stderr
    saved, _saved_stderr = _saved_stderr, None
    if saved is not None:
        try:
            os.dup2(saved, 2)
        except OSError:
            pass


def _connect_error(addr: str, e: BaseException) -> Exception:
    text = f"{type(e).__name__}: {e}"
    if "uthentication" in text or "token" in text.lower():
        return UsageError(
            f"the Ray cluster at {addr} refused areal's connection: "
            + str(e).splitlines()[0].split(". ")[0],
            hint="a cluster with token auth wants RAY_AUTH_MODE=token and the token in "
            "RAY_AUTH_TOKEN or in the file RAY_AUTH_TOKEN_PATH names (default "
            "~/.ray/auth_token); `ray get-auth-token` on the head prints it",
        )
    if isinstance(e, ConnectionError) or "connect" in text.lower() or "GCS" in text:
        return Unreachable(
            f"cannot reach the Ray cluster at {addr}: {str(e).splitlines()[0][:300]}",
            hint="check RAY_ADDRESS (HEAD:PORT, the head's GCS port) and that the head is up",
        )
    return UsageError(f"cannot connect to the Ray cluster at {addr}: {text[:300]}")


# -- nodes and resources ---------------------------------------------------------------------


@dataclass
class Node:
    node_id: str
    ip: str
    total: dict[str, float] = field(default_factory=dict)
    free: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        parts = []
        for r in ("GPU", "CPU"):
            if self.total.get(r):
                parts.append(f"{r} {self.free.get(r, 0):g}/{self.total[r]:g} free")
        return f"{self.ip} ({', '.join(parts) or 'nothing'})"


def nodes() -> list[Node]:
    """The live nodes, with what each has and has free now."""
    import ray
    from ray._private import state

    free = state.available_resources_per_node()
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        nid = n["NodeID"]
        total = {k: float(v) for k, v in n.get("Resources", {}).items()}
        out.append(Node(nid, n["NodeManagerAddress"], total, dict(free.get(nid, {}))))
    return sorted(out, key=lambda x: x.ip)


def fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v)


def words(need: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in need.items() if v) or "nothing"


# -- actors ------------------------------------------------------------------------------------


@dataclass
class ActorState:
    name: str
    state: str  # ALIVE, PENDING_CREATION, DEPENDENCIES_UNREADY, RESTARTING, DEAD
    node_ip: str | None = None
    death: str | None = None  # Ray's words on why it died


def actor_states(names: list[str]) -> dict[str, ActorState]:
    """name → state of the named actors of namespace `areal` (one call to the GCS). A name
    missing from the answer never existed or was forgotten."""
    from ray._private import state

    wanted = set(names)
    out: dict[str, ActorState] = {}
    for info in state.actors().values():
        name = info.get("Name")
        if name not in wanted or info.get("RayNamespace", NAMESPACE) != NAMESPACE:
            continue
        st = ActorState(name, info.get("State", "?"), (info.get("Address") or {}).get("IPAddress"))
        if st.state == "DEAD":
            st.death = _death(info.get("DeathCause")) or "dead"
            if st.node_ip:
                st.death += f" (node {st.node_ip})"
        prev = out.get(name)
        # A name is reused only after its actor died: the live one is the one that counts.
        if prev is None or prev.state == "DEAD":
            out[name] = st
    return out


def _death(cause) -> str | None:
    """Ray's words on an actor's death, on one line: its message is a protobuf text field,
    escapes and all, and names the node by an id nobody can look up."""
    if not cause:
        return None
    text = str(cause)
    for key in ("error_message:", "error_message :"):
        if key in text:
            msg = text.split(key, 1)[1].strip().splitlines()[0].strip().strip('"')
            msg = msg.replace("\\'", "'")
            parts = [x.strip() for x in re.split(r"\\[nt]", msg) if x.strip()]
            parts = [re.sub(r"\s*Node Id: [0-9a-f]+\.?", "", x).rstrip(". ") for x in parts]
            return "; ".join(x for x in parts if x)
    return text.splitlines()[0][:200]


def wait_refs(refs: list, timeout: float) -> tuple[list, list]:
    import ray

    return ray.wait(refs, num_returns=len(refs), timeout=max(0.0, timeout))


def now() -> float:
    return time.monotonic()
