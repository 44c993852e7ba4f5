"""The caller's side of diagnose.remote: `doctor profile`, `memory` and `diverge` run
`python -m areal_cli.diagnose.remote ...` on every node of a cluster job at once, the job's way
(Job.run_on_nodes), and get each node's JSON answer back, or why the node gave none. Files
travel inside the JSON, packed.
"""

from __future__ import annotations

import base64
import gzip
import json
import sys

from areal_cli.diagnose.targets import Job

# A recorded profile or snapshot larger than this stays on its node (named in the error).
MAX_FILE = 48 << 20


def pack(data: bytes) -> str:
    return base64.b64encode(gzip.compress(data, compresslevel=3)).decode()


def unpack(text: str) -> bytes:
    return gzip.decompress(base64.b64decode(text))


def on_nodes(
    job: Job, argv: list[str], timeout: float, per_node: dict[str, list[str]] | None = None
) -> dict[str, tuple[dict | None, str | None]]:
    """node -> (its JSON answer, why there is none) of `remote <argv>` run on every node of the
    cluster job at once, the job's way (Job.run_on_nodes: its scheduler's run_on_nodes)."""

    def command(node: str) -> list[str]:
        out = [sys.executable, "-m", "areal_cli.diagnose.remote", *argv]
        if job.nodes.get(node):
            out += ["--pids", ",".join(map(str, job.nodes[node]))]
        if job.marker:
            out += ["--marker", job.marker]
        return out + list((per_node or {}).get(node, []))

    out: dict[str, tuple[dict | None, str | None]] = {}
    for node, (stdout, why) in job.run_on_nodes(command, timeout).items():
        try:
            data = json.loads((stdout or "").strip().splitlines()[-1])
        except (ValueError, IndexError):
            out[node] = (None, why or f"node {node} answered nothing")
            continue
        if not isinstance(data, dict):
            out[node] = (None, f"node {node} answered {str(data)[:80]!r}")
        elif data.get("error"):
            out[node] = (data, f"node {node}: {data['error']}")
        else:
            out[node] = (data, None)
    return out
