"""The one actor areal puts on a Ray node: a Step holds its share of the node's resources
(a server replica's t·p GPUs, or a placement-group bundle of one training node) and runs one
runner there, the same runners as on Slurm (launchers/replica.py, launchers/torchrun.py).

What Ray does and this makes up for (measured with ray 2.60):
- Ray sets CUDA_VISIBLE_DEVICES from num_gpus, and for an actor with none it sets nothing
  (ray#54868), so a CPU step would see every GPU: the runner gets the GPUs Ray assigned,
  and an empty list when there are none. RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES does
  not change that: the assigned ids still come from ray.get_gpu_ids().
- killing an actor kills its children, not theirs (torchrun's ranks, a server under its
  replica runner): every process of the job carries AREAL_JOB_MARKER, and stop() and
  sweep() end them by it on this node.
- the runner's exit code is left in the run folder (`<label>.exit`), as Slurm's steps do,
  so it is known even when nobody was connected to hear it.
- a fresh Python process on a node costs a second or more (interpreter, imports), most of
  `areal doctor hang` on a Ray job when each node's sampler was one: a command
  `python -m areal_cli.MODULE ARGS` runs inside this actor instead (run_module), its
  `node_main(ARGS)` (or the module as __main__) with its output captured, the argv
  contract unchanged, so every node-side module of the doctor is reached the same way.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from areal_cli import procs
from areal_cli.launchers.replica import replica_processes
from areal_cli.schedulers.ray import watch

MARKER_ENV = "AREAL_JOB_MARKER"


class Step:
    def __init__(self, label: str, run_dir: str, marker: str, node_index: int = 0,
                 argv: list[str] | None = None, env: dict[str, str] | None = None):  # fmt: skip
        self.label, self.run_dir, self.marker, self.node_index = label, run_dir, marker, node_index
        self.proc: subprocess.Popen | None = None
        self.code: int | None = None
        self._waiter: threading.Thread | None = None
        self._dog = None  # the job's watchdog, in the first training node's actor
        if argv:
            # Started as soon as it is placed: no round trip between placing and starting.
            self.start(argv, env or {})

    def where(self) -> dict:
        """The node this step landed on and the GPUs Ray gave it."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
        }

    def _node_env(self) -> dict[str, str]:
        """How the job's processes learn their node and job (launchers.node, the worker
        runtime) and which GPUs they may use: exactly those Ray gave this step."""
        where = self.where()
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(where["gpus"]),
            "AREAL_SCHEDULER_NAME": "ray",
            "AREAL_NODE_NAME": where["ip"],
            "AREAL_NODE_ADDR": where["ip"],
            "AREAL_NODE_INDEX": str(self.node_index),
            "AREAL_SCHEDULER_JOB_ID": self.marker[-8:],
        }

    def endpoint(self) -> str:
        """host:port free on this node: where the training nodes' rendezvous meets."""
        import socket

        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"

    def start(self, argv: list[str], env: dict[str, str]) -> int:
        """Run the runner ("{python}" in argv: this node's interpreter)."""
        argv = [sys.executable if a == "{python}" else a for a in argv]
        full = {**os.environ, **env, **self._node_env()}
        full[MARKER_ENV] = self.marker
        out = Path(self.run_dir) / f"{self.label}.out"
        with open(out, "ab") as log:
            self.proc = subprocess.Popen(
                argv, env=full, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        proc = self.proc

        def wait() -> None:
            code = proc.wait()
            self.code = 128 - code if code < 0 else code
            exit_file = Path(self.run_dir) / f"{self.label}.exit"
            try:
                tmp = exit_file.with_name(f".{exit_file.name}.tmp")
                tmp.write_text(f"{self.code}\n")
                os.replace(tmp, exit_file)
            except OSError:
                pass

        self._waiter = threading.Thread(target=wait, daemon=True)
        self._waiter.start()
        return proc.pid

    def watch(self, nodes: int) -> bool:
        """Start the job's watchdog here (schedulers/ray/watch.py); False when it has none."""
        if self._dog is None or self._dog.stop.is_set():  # re-armed after a restart
            self._dog = watch.start(self.run_dir, lambda: watch.stop_trainers(self.marker, nodes))
        return self._dog is not None

    def poll(self) -> int | None:
        if self._waiter is not None and not self._waiter.is_alive():
            return self.code
        return None

    def stop(self, grace: float = 10.0, sweep_node: bool = True) -> int | None:
        """SIGTERM the runner (it deregisters its server, torchrun stops its ranks), SIGKILL
        after `grace`, then whatever of the job is left on this node."""
        if self._dog is not None:
            # Not joined: a watchdog whose verdict is stopping the job waits on this call.
            self._dog.stop.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self._waiter is not None:
            self._waiter.join(timeout=5.0)
        if sweep_node:
            sweep(self.marker)
        return self.code

    def run(self, argv: list[str], timeout: float) -> tuple[int, str, str]:
        """A short command on this node (the doctor's sampler), its output back: an areal
        module in this process (see run_module), anything else as a process of its own."""
        module = areal_module(argv)
        if module is not None:
            if self.marker:
                _adopt_node_env(self._node_env())
            return run_module(module, argv[3:], timeout)
        argv = [sys.executable if a == "{python}" else a for a in argv]
        env = {**os.environ, **(self._node_env() if self.marker else {})}
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                 check=False, env=env)  # fmt: skip
        except subprocess.TimeoutExpired:
            return 124, "", f"no answer within {timeout:g}s"
        return res.returncode, res.stdout, res.stderr


def sweep(marker: str, index: int | None = None, grace: float = 3.0) -> int:
    """Every process of the job on this node (of one replica when `index` is given)."""
    if index is None:
        return procs.kill_job(marker, grace=grace)
    found = replica_processes(marker, index)
    return procs.kill_job(None, roots=[p.pid for p in found], grace=grace) if found else 0


def run_on_node(argv: list[str], timeout: float) -> tuple[int, str, str]:
    return Step("run", "", "").run(argv, timeout)


# -- areal's node-side modules, run in this process ---------------------------------------------


def areal_module(argv: list[str]) -> str | None:
    """The module of `PYTHON -m areal_cli.X ...` (PYTHON: "{python}" or any python binary,
    which here is this node's own interpreter), else None."""
    if len(argv) < 3 or argv[1] != "-m" or not argv[2].startswith("areal_cli."):
        return None
    exe = os.path.basename(argv[0])
    return argv[2] if argv[0] == "{python}" or exe.startswith("python") else None


def _adopt_node_env(node: dict[str, str]) -> None:
    """What a node-side module reads to know its node and job (AREAL_NODE_NAME: several
    Ray nodes may share a host), as a process started here would have it. Not the GPUs:
    Ray set this process's CUDA_VISIBLE_DEVICES itself."""
    for k, v in node.items():
        if k.startswith("AREAL_") and os.environ.get(k) != v:
            os.environ[k] = v


class _PerThread:
    """sys.stdout/sys.stderr of this process: what a thread bound to a buffer writes goes
    there, everything else (Ray's own output) where it went before. Several modules may
    run at once (the actor takes concurrent calls), so no global swap. Anything else
    (fileno, isatty, encoding) is the stream's own."""

    def __init__(self, base, which: int):
        self.base, self.which = base, which

    def write(self, text: str) -> int:
        bound = getattr(_bound, "streams", None)
        return (bound[self.which] if bound else self.base).write(text)

    def flush(self) -> None:
        if getattr(_bound, "streams", None) is None:
            self.base.flush()

    def __getattr__(self, name):
        return getattr(self.base, name)


_bound = threading.local()
_install_lock = threading.Lock()
_argv_lock = threading.Lock()  # a module run as __main__ reads the one sys.argv


def _install() -> None:
    with _install_lock:
        if not isinstance(sys.stdout, _PerThread):
            sys.stdout = _PerThread(sys.stdout, 0)
        if not isinstance(sys.stderr, _PerThread):
            sys.stderr = _PerThread(sys.stderr, 1)


def run_module(module: str, args: list[str], timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m MODULE ARGS` run in this process: its
    `node_main(ARGS)` when it has one, else the module as __main__ with sys.argv set. The
    imports it needs stay loaded for the next call. Past `timeout` it is left to finish in
    its thread (a thread cannot be killed) and the caller is told so."""
    _install()
    done: list[tuple[int, str, str]] = []

    def call() -> None:
        import importlib
        import traceback

        out, err = io.StringIO(), io.StringIO()
        _bound.streams = (out, err)
        code: object = 0
        try:
            mod = importlib.import_module(module)
            entry = getattr(mod, "node_main", None)
            if callable(entry):
                code = entry(list(args))
            else:
                import runpy
                import warnings

                with _argv_lock, warnings.catch_warnings():
                    # Imported above to look for node_main: runpy's warning about that says
                    # nothing here (the module's body runs again, as __main__).
                    warnings.simplefilter("ignore", RuntimeWarning)
                    saved, sys.argv = sys.argv, [module, *args]
                    try:
                        runpy.run_module(module, run_name="__main__", alter_sys=False)
                    finally:
                        sys.argv = saved
        except SystemExit as e:
            code = e.code
        except BaseException:
            err.write(traceback.format_exc())
            code = 1
        finally:
            _bound.streams = None
        if code is None:
            code = 0
        elif not isinstance(code, int):
            err.write(f"{code}\n")
            code = 1
        done.append((code, out.getvalue(), err.getvalue()))

    t = threading.Thread(target=call, name=f"areal-{module}", daemon=True)
    t.start()
    t.join(timeout)
    if not done:
        return 124, "", f"no answer within {timeout:g}s"
    return done[0]
