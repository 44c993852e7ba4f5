"""torchrun in one place: its argv, its rendezvous, and its output split per rank.

    python -m areal_cli.launchers.torchrun --log-dir D -- python -m torch.distributed.run ...

runs one node's torchrun and writes rank-N.log per global rank and torchrun.log beside them.

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

from areal_cli.files import private_dir
from areal_cli.launchers import node
from areal_cli.logfiles import fresh_log

# torchrun --tee prefixes each worker line with "[<role><local_rank>]:", or with the template.
RANK_PREFIX = re.compile(rb"^\[(?:default|rank)(\d+)\]:")
LINE_PREFIX_ENV = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"}
DEFAULT_PORT = 29500  # torchrun's own default master port
RDZV_TOKEN = "{rdzv_endpoint}"  # in a node runner's argv: the endpoint the first node picked


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
    """The TCP port a torchrun agent listens on (its c10d store), once it does; `pid` is the
    agent or the node runner that started it."""
    import psutil

    try:
        proc = psutil.Process(pid)
        agents = [proc, *proc.children()]
    except psutil.Error:
        return None
    for agent in agents:
        try:
            conns = agent.net_connections(kind="tcp")
        except psutil.Error:
            continue
        ports = sorted(c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr)
        if ports:
            return ports[0]
    return None


def run_node(
    argv: list[str],
    log_dir: str | Path,
    own_log: str = "torchrun.log",
    env: dict[str, str] | None = None,
) -> int:
    """Run one node's torchrun, splitting its output into rank-N.log per global rank and
    `own_log` for torchrun's own lines. Returns its exit code (128+signal when killed)."""
    import errno
    import os
    import signal
    import subprocess

    log_dir = private_dir(log_dir)
    files: dict[str, int] = {}

    def fd(name: str) -> int:
        if name not in files:
            # A new run of the job starts its logs afresh.
            files[name] = fresh_log(log_dir / name)
        return files[name]

    fd(own_log)
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=env,
    )  # fmt: skip
    stopped: list[int] = []

    def stop(sig: int, _frame) -> None:
        # torchrun turns SIGTERM/SIGINT into stopping its workers; pass them on.
        if not stopped:
            os.write(fd(own_log), f"stopping: {signal.Signals(sig).name}\n".encode())
        stopped.append(sig)
        proc.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        rank, body = split_rank(raw)
        if rank is None and stopped:
            continue  # torchrun answers a stop with a SignalException traceback: not news
        try:
            os.write(fd(f"rank-{rank}.log" if rank is not None else own_log), body)
        except OSError as e:
            # A full disk: the line is lost, but the pipe is still drained, so torchrun and
            # its workers are not killed by a broken pipe; the supervisor names the disk.
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
    code = proc.wait()
    for f in files.values():
        os.close(f)
    return 128 - code if code < 0 else code


def main(args: list[str] | None = None) -> int:
    """python -m areal_cli.launchers.torchrun --log-dir D [--own-log NAME] [--env-file F]
    [--rendezvous-file F] -- TORCHRUN ARGV

    On a cluster every node runs one of these (a Slurm step with a task per node):
    `{node}` in --own-log is the node's name; with --rendezvous-file, `{rdzv_endpoint}` in
    the argv becomes host:port on the first node, picked there (launchers.node.meet);
    --env-file adds the workers' environment from a JSON file readable by its user only, so
    that an API key is never on a command line or in a batch script."""
    import argparse
    import json
    import os
    import sys

    ap = argparse.ArgumentParser(prog="python -m areal_cli.launchers.torchrun")
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--own-log", default="torchrun.log")
    ap.add_argument("--env-file")
    ap.add_argument("--rendezvous-file")
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    a = ap.parse_args(args if args is not None else sys.argv[1:])
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    if not argv:
        ap.error("give the torchrun command after --")
    env = None
    if a.env_file:
        env = {**os.environ, **json.loads(Path(a.env_file).read_text())}
    if a.rendezvous_file:
        endpoint = node.meet(a.rendezvous_file)
        argv = [x.replace(RDZV_TOKEN, endpoint) for x in argv]
    own_log = a.own_log.replace("{node}", node.name())
    return run_node(argv, a.log_dir, own_log, env)


if __name__ == "__main__":
    import sys

    sys.exit(main())
