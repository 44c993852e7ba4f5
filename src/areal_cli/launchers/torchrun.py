"""torchrun in one place: its argv, its rendezvous, and its output split per rank.

Every scheduler (local processes, Slurm steps) and `areal doctor allreduce` launch workers
through `argv()`, so the rendezvous rules live here:

- one node, no port given: torchrun's standalone rendezvous on port 0. The OS picks a free
  port for the c10d store, which the workers share as MASTER_PORT, so two jobs started at
  the same moment never race for a port. `rendezvous_port()` reads back the port it got.
- several nodes: c10d rendezvous at an endpoint on the first node (a port chosen there), or
  the static master address/port the user gave.

Worker output comes back through torchrun's stdout with a "[rankN]:" prefix (global ranks,
so per-rank logs are right on every node); `split_rank()` takes it apart.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

# torchrun --tee prefixes each worker line with "[<role><local_rank>]:", or with the template.
RANK_PREFIX = re.compile(rb"^\[(?:default|rank)(\d+)\]:")
LINE_PREFIX_ENV = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"}
DEFAULT_PORT = 29500  # torchrun's own default master port


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of one job meet. No endpoint on one node: standalone, port 0."""

    nnodes: int = 1
    node_rank: int | None = None  # static rendezvous only; c10d assigns ranks itself
    endpoint: str | None = None  # host:port
    backend: str = "c10d"  # c10d | static (torchrun's --master-addr/--master-port)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1 and self.endpoint is None

    def args(self) -> list[str]:
        if self.standalone:
            return ["--standalone"]
        if self.endpoint is None:
            raise ValueError("a multi-node rendezvous needs an endpoint")
        if self.backend == "static":
            host, _, port = self.endpoint.rpartition(":")
            return [
                "--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank or 0),
                "--master-addr", host, "--master-port", port,
            ]  # fmt: skip
        return [
            "--nnodes", str(self.nnodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
        ]  # fmt: skip


def argv(
    python: str,
    nproc: int,
    target: list[str],
    *,
    rendezvous: Rendezvous,
    log_dir: str | Path | None = None,
) -> list[str]:
    """`python -m torch.distributed.run ... target`; `target` is [script, args...] or
    ["-m", module, args...]. With `log_dir`, every rank's output is teed to stdout with its
    rank prefix (see split_rank)."""
    cmd = [python, "-m", "torch.distributed.run", *rendezvous.args()]
    cmd += ["--nproc-per-node", str(nproc)]
    if log_dir is not None:
        cmd += ["--tee", "3", "--log-dir", str(log_dir)]
    return cmd + list(target)


def split_rank(line: bytes) -> tuple[int | None, bytes]:
    """(global rank, the line without its prefix), or (None, line) for torchrun's own lines."""
    m = RANK_PREFIX.match(line)
    if m is None:
        return None, line
    return int(m.group(1)), line[m.end() :]


def rendezvous_port(pid: int) -> int | None:
    """The TCP port the torchrun agent `pid` listens on (its c10d store), once it does."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return None
    ports = sorted(c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr)
    return ports[0] if ports else None
