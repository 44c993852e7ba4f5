"""`areal doctor allreduce`, the library half: launch templates/allreduce_repro.py with torchrun,
collect its per-size rows, and when it overruns its timeout, diagnose the hang on its ranks and
tear it down."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from areal_cli import gpus, procs
from areal_cli.diagnose import hang, hang_judge, targets
from areal_cli.errors import LaunchError, UsageError
from areal_cli.launchers import torchrun

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DEFAULT_SIZES = {"nccl": "1K:256M", "gloo": "1K:16M"}
FORCE_HANG_ENV = "AREAL_ALLREDUCE_FORCE_HANG"
RESULTS_ENV = "AREAL_ALLREDUCE_RESULTS"


@dataclass
class Row:
    size: int
    count: int
    type: str
    redop: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RunResult:
    backend: str
    nproc: int
    sizes: list[int]
    rows: list[Row] = field(default_factory=list)
    timed_out: bool = False
    hang_reports: list = field(default_factory=list)  # HangReport, when timed out
    hang_error: str | None = None  # why the hang diagnosis itself failed
    output_tail: str = ""
    elapsed_s: float = 0.0

    @property
    def wrong(self) -> int:
        return sum(r.wrong for r in self.rows)

    @property
    def avg_busbw(self) -> float:
        return sum(r.busbw_gbps for r in self.rows) / len(self.rows) if self.rows else 0.0

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "nproc": self.nproc,
            "sizes": self.sizes,
            "rows": [r.to_json() for r in self.rows],
            "wrong": self.wrong,
            "avg_busbw_gbps": self.avg_busbw,
            "timed_out": self.timed_out,
            "hang": hang_judge.to_json(self.hang_reports) if self.hang_reports else None,
            "hang_error": self.hang_error,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def script_path() -> Path:
    return Path(str(resources.files("areal_cli.templates").joinpath("allreduce_repro.py")))


def script_text() -> str:
    return script_path().read_text()


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for suffix in ("IB", "B"):
        if t.endswith(suffix) and len(t) > len(suffix):
            t = t[: -len(suffix)]
    unit = t[-1] if t and t[-1] in "KMG" else ""
    number = t[:-1] if unit else t
    try:
        value = float(number)
    except ValueError:
        raise UsageError(
            f"bad size {text!r}", hint="write bytes with an optional K, M or G suffix: 1K, 256M"
        ) from None
    if value <= 0:
        raise UsageError(f"size {text!r} must be positive")
    return int(value * UNITS[unit])


def parse_sizes(spec: str) -> list[int]:
    """'1K:256M' -> [1024, 2048, ..., 268435456] (doubling); a single size is one row."""
    lo, sep, hi = spec.partition(":")
    lo_b = parse_size(lo)
    hi_b = parse_size(hi) if sep else lo_b
    if hi_b < lo_b:
        raise UsageError(
            f"--sizes {spec}: the maximum is smaller than the minimum", hint="e.g. 1K:16M"
        )
    out, size = [], lo_b
    while size <= hi_b:
        out.append(size)
        size *= 2
    return out


def default_backend() -> str:
    """nccl when this host has NVIDIA GPUs, else gloo (no torch import: nvidia-smi decides)."""
    return "nccl" if _gpu_count() > 0 else "gloo"


def default_nproc(backend: str) -> int:
    return max(1, _gpu_count()) if backend == "nccl" else 2


def _gpu_count() -> int:
    try:
        return len(gpus.query_nvidia_smi())
    except Exception:
        return 0


def run(
    *,
    nproc: int,
    backend: str,
    sizes: str,
    iters: int = 20,
    warmup: int = 5,
    timeout: float = 120.0,
    force_hang: bool = False,
    on_row: Callable[[Row], None] | None = None,
    on_hang: Callable[[], None] | None = None,
) -> RunResult:
    """Run the repro; on timeout diagnose the hang, tear everything down, mark the result."""
    _check(nproc=nproc, backend=backend, iters=iters, warmup=warmup)
    result = RunResult(backend=backend, nproc=nproc, sizes=parse_sizes(sizes))

    tmp = Path(tempfile.mkdtemp(prefix="areal-allreduce-"))
    results_file = tmp / "rows.jsonl"
    marker = f"allreduce-{uuid.uuid4().hex[:12]}"
    repro = [str(script_path()), "--backend", backend, "--sizes", sizes,
             "--iters", str(iters), "--warmup", str(warmup),
             # Longer than our own timeout: a hang must still be a hang when the doctor looks.
             "--pg-timeout", str(timeout + 600)]  # fmt: skip
    argv = torchrun.argv(sys.executable, nproc, repro, rendezvous=torchrun.Rendezvous())
    started = time.monotonic()
    proc = procs.spawn(argv, env=_env(marker, results_file, force_hang), stdout=subprocess.PIPE)
    output: list[str] = []
    reader = threading.Thread(target=_drain, args=(proc, output), daemon=True)
    reader.start()
    try:
        _watch(proc, results_file, result, on_row, deadline=started + timeout)
        if result.timed_out:
            if on_hang:
                on_hang()
            _diagnose(proc.pid, result)
    finally:
        procs.kill_job(marker, [proc.pid], grace=2.0)
        reader.join(timeout=2.0)
        # The rows written last; those read so far are in result.rows, each read once.
        _new_rows(results_file, len(result.rows), result, on_row)
        result.elapsed_s = time.monotonic() - started
        result.output_tail = "".join(output)[-4000:]
        shutil.rmtree(tmp, ignore_errors=True)
    if not result.timed_out and proc.returncode != 0:
        raise LaunchError(
            f"the all_reduce repro failed (torchrun exit code {proc.returncode})",
            detail=_tail(result.output_tail, 25),
            hint="rerun with the nccl preset for NCCL's own logs: "
            "areal doctor env --preset nccl -- areal doctor allreduce ...",
        )
    return result


def _check(*, nproc: int, backend: str, iters: int, warmup: int) -> None:
    """The run's options, and what it needs here (torch; GPUs for nccl), before it starts."""
    if backend not in ("nccl", "gloo"):
        raise UsageError(f"unknown backend {backend!r}", hint="choose nccl or gloo")
    if nproc < 1:
        raise UsageError("--nproc must be at least 1")
    if iters < 1 or warmup < 0:
        raise UsageError("--iters must be >= 1 and --warmup >= 0")
    if importlib.util.find_spec("torch") is None:
        raise UsageError(
            f"torch is not importable by {sys.executable}",
            hint="install PyTorch into the environment areal runs from",
        )
    if backend == "nccl":
        n = _gpu_count()
        if n == 0:
            raise UsageError(
                "backend nccl needs NVIDIA GPUs; none found", hint="use --backend gloo"
            )
        if nproc > n:
            raise UsageError(f"--nproc {nproc} but only {n} GPUs here", hint=f"--nproc {n}")


def _env(marker: str, results_file: Path, force_hang: bool) -> dict[str, str]:
    """The repro's environment: our marker (to find and kill its processes), where it writes
    its rows, and the forced hang only when asked (never inherited)."""
    env = {
        **os.environ,
        procs.MARKER_ENV: marker,
        RESULTS_ENV: str(results_file),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    env.pop(FORCE_HANG_ENV, None)
    if force_hang:
        env[FORCE_HANG_ENV] = "1"
    return env


def _watch(proc: subprocess.Popen, results_file: Path, result: RunResult, on_row,
           *, deadline: float) -> None:  # fmt: skip
    """Rows as the repro writes them (into `result.rows`), until it exits or the deadline
    passes (then `result.timed_out`)."""
    while True:
        _new_rows(results_file, len(result.rows), result, on_row)
        if proc.poll() is not None:
            return
        if time.monotonic() >= deadline:
            result.timed_out = True
            return
        time.sleep(0.05)


def _diagnose(torchrun_pid: int, result: RunResult) -> None:
    try:
        jobs = targets.resolve(pids=[torchrun_pid])
        result.hang_reports = hang.diagnose(jobs, timeout=5.0)
    except Exception as e:  # the diagnosis is a bonus; the timeout is the finding
        result.hang_error = getattr(e, "message", None) or str(e)


def _drain(proc: subprocess.Popen, sink: list[str]) -> None:
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        sink.append(raw.decode(errors="replace"))


def _new_rows(path: Path, seen: int, result: RunResult, on_row) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return seen
    for line in lines[seen:]:
        try:
            d = json.loads(line)
        except ValueError:
            break  # half-written line: read it next time
        row = Row(
            size=d["size"],
            count=d["count"],
            type=d["type"],
            redop=d["redop"],
            time_us=d["time_us"],
            algbw_gbps=d["algbw_gbps"],
            busbw_gbps=d["busbw_gbps"],
            wrong=d["wrong"],
        )
        result.rows.append(row)
        seen += 1
        if on_row:
            on_row(row)
    return seen


def _tail(text: str, n: int) -> str:
    return "\n".join(text.splitlines()[-n:])
