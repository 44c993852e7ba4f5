"""What a newcomer meets first, run as they type it: the demo with AREAL_HOME exported,
`--registry` on every command that reads the registry, a dry run of servers whose model
lives elsewhere, flags over a job YAML, `--servers` naming what answers there."""

from __future__ import annotations

import json
import os
import subprocess

import psutil

from tests.helpers import REPO, areal, fake_serve_args, wait_for


def test_demo_with_areal_home_exported_finds_no_leak_in_its_parents(tmp_path, areal_env):
    """Parents that carry the demo's AREAL_HOME (a shell, make, a pipe's tail) are not what
    the demo started: its leak check passes and says so."""
    home, reg = areal_env
    env = {**os.environ, "AREAL_HOME": str(home), "AREAL_REGISTRY": str(reg),
           "AREAL_DEMO_MODEL": str(tmp_path / "demo-model")}  # fmt: skip
    # bash → bash scripts/demo.sh | tail: as `make demo | tail` in a shell that exported it.
    demo = subprocess.Popen(
        ["bash", "-c", "bash scripts/demo.sh steps=2 2>&1 | tail -n 40; exit ${PIPESTATUS[0]}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # The mark reaches what the demo starts (its server), so the check is not blind.
        server = wait_for(lambda: _marked_server(demo.pid), 300, "no marked demo server")
        assert server.environ()["AREAL_HOME"] == str(home)
        out, _ = demo.communicate(timeout=600)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, out
    assert "nothing left running. done." in out and "left behind" not in out


def _marked_server(root: int):
    """The hf server the demo under `root` started, found by the demo's mark, not by its
    parentage (a detached server is reparented)."""
    try:
        run = next(
            p.environ()["AREAL_DEMO_RUN"]
            for p in psutil.Process(root).children(recursive=True)
            if "AREAL_DEMO_RUN" in _environ(p)
        )
    except StopIteration:
        return None
    for p in psutil.process_iter():
        if _environ(p).get("AREAL_DEMO_RUN") == run and "areal_cli.server" in " ".join(_cmdline(p)):
            return p
    return None


def _environ(p) -> dict:
    try:
        return p.environ()
    except psutil.Error:
        return {}


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_registry_flag_is_taken_by_every_command_that_reads_the_registry(tmp_path, areal_env):
    """--registry, documented as AREAL_REGISTRY's override, on serve, ps, logs, key, stop
    (doctor hang: test_examples); a registry of its own, not the environment's."""
    model = tmp_path / "m"
    model.mkdir()
    other = tmp_path / "other-registry"
    res = areal(*fake_serve_args(model, "--detach", "--json", "--registry", str(other)),
                check=0, timeout=120)  # fmt: skip
    (server,) = json.loads(res.stdout)["servers"]
    try:
        from areal_cli.registry import open_registry

        entries = open_registry(str(other)).list("default", "trial0").servers
        assert [e.addr for e in entries] == [server["addr"]]
        (job,) = json.loads(areal("ps", "--json", "--registry", str(other), check=0).stdout)
        assert job["state"] == "running" and job["servers"][0]["addr"] == server["addr"]
        logs = areal("logs", "default/trial0", "--registry", str(other), "-n", "5", check=0)
        assert "[server-0]" in logs.stdout
        key = areal("key", "default/trial0", "--registry", str(other), check=0).stdout.strip()
        assert len(key) >= 16
    finally:
        stop = areal("stop", "default/trial0", "--registry", str(other), check=0, timeout=60)
    assert "default/trial0 stopped" in stop.stdout
    assert open_registry(str(other)).list("default", "trial0").servers == []


def test_dry_run_plans_servers_whose_model_is_not_on_this_host(areal_env, tmp_path):
    """The model may exist only on the nodes that run the servers: a dry run plans with it
    and notes its absence; the CPU build a host without GPUs gets is said too."""
    missing = tmp_path / "models" / "m"
    res = areal("serve", "--model", str(missing), "--alloc", "sglang:d2t2", "--dry-run",
                check=0)  # fmt: skip
    assert f"note model {missing} not found on this host" in res.stdout
    assert "planned sglang's CPU build" in res.stdout and "--device cpu" in res.stdout
    plan = json.loads(areal("serve", "--model", str(missing), "--alloc", "sglang:d2t2",
                            "--gpus", "0,1,2,3", "--dry-run", "--json", check=0).stdout)  # fmt: skip
    assert [p["gpus"] for p in plan["processes"]] == [[0, 1], [2, 3]]
    assert plan["notes"] == [f"model {missing} not found on this host"]
    # Starting for real still needs the model here.
    res = areal("serve", "--model", str(missing), "--alloc", "sglang:d2t2", check=2)
    assert "does not exist" in res.stderr


def test_flags_win_over_the_job_yaml_with_the_keys_they_determine(areal_env, tmp_path):
    """templates/serve.yaml says alloc: sglang:d4t1; --backend hf rewrites that alloc's
    backend, --dp its replicas, --alloc replaces the YAML's backend; each said in a note."""
    model = tmp_path / "m"
    model.mkdir()
    yaml = str(REPO / "templates" / "serve.yaml")

    def plan(*flags):
        out = areal("serve", "--config", yaml, "--model", str(model), *flags, "--dry-run",
                    "--json", check=0).stdout  # fmt: skip
        got = json.loads(out)
        return got["alloc"], {p["backend"] for p in got["processes"]}, got["notes"]

    alloc, engines, notes = plan("--backend", "hf")
    assert (alloc, engines) == ("hf:d4t1", {"hf"})
    assert "--backend hf rewrote the job YAML's alloc sglang:d4t1 as hf:d4t1" in notes
    alloc, engines, notes = plan("--dp", "2")
    assert (alloc, engines) == ("sglang:d2t1", {"sglang"})
    alloc, engines, notes = plan("--alloc", "hf:d1")
    assert (alloc, engines) == ("hf:d1", {"hf"})
    assert "--alloc hf:d1 replaces the job YAML's backend: sglang" in notes
    # Flags among themselves still have to agree.
    res = areal("serve", "--config", yaml, "--model", str(model), "--alloc", "hf:d1",
                "--backend", "vllm", "--dry-run", check=2)  # fmt: skip
    assert "disagrees" in res.stderr


def test_servers_given_by_address_are_asked_which_engine_they_run(areal_env, tmp_path):
    from areal_cli.modelgen import create_tiny_model

    tiny = create_tiny_model(tmp_path / "tiny", seed=0)
    script = tmp_path / "t.py"
    script.write_text("")
    res = areal("serve", "--backend", "hf", "--model", str(tiny), "--detach", "--json",
                "--api-key", "none", check=0, timeout=240)  # fmt: skip
    (hf,) = json.loads(res.stdout)["servers"]
    fake = tmp_path / "fake"
    fake.mkdir()
    res = areal(*fake_serve_args(fake, "--detach", "--json", "--trial", "fake", "--api-key",
                                 "none"), check=0, timeout=120)  # fmt: skip
    (other,) = json.loads(res.stdout)["servers"]
    try:
        res = areal("train", "--alloc", "fsdp:d1", "--servers", hf["addr"], str(script),
                    "--dry-run", check=0)  # fmt: skip
        assert f"servers 1 hf: {hf['addr']}" in res.stderr
        # A server that does not say what it runs: said so, not called SGLang.
        res = areal("train", "--alloc", "fsdp:d1", "--servers", other["addr"], str(script),
                    "--dry-run", check=0)  # fmt: skip
        assert "servers 1 (engine unknown; sglang protocol assumed)" in res.stderr
    finally:
        areal("stop", "--all", check=0, timeout=60)


def test_ps_and_doctor_env_read_at_80_columns_and_in_a_pipe(tmp_path, areal_env):
    """A pipe is laid out 80 wide: nothing is cut with "…", pids and addresses stay whole,
    and a meaning column is never squeezed to a word per line."""
    model = tmp_path / "m"
    model.mkdir()
    res = areal(*fake_serve_args(model, "--alloc", "hf:d2", "--detach", "--json",
                                 "--experiment", "a-longer-experiment"), check=0, timeout=120)  # fmt: skip
    servers = json.loads(res.stdout)["servers"]
    piped = {"COLUMNS": ""}  # as `areal ps | cat`: no terminal, no width given
    try:
        out = areal("ps", env=piped, check=0).stdout
        (job,) = json.loads(areal("ps", "--json", check=0).stdout)
    finally:
        areal("stop", "--all", check=0, timeout=60)
    assert "…" not in out and max(map(len, out.splitlines())) <= 80, out
    words = out.split()
    assert "a-longer-experiment/trial0" in words
    assert all(str(pid) in words for pid in job["pids"]), out
    assert all(s["addr"] in words for s in servers), out

    from areal_cli.diagnose import presets

    explain = areal("doctor", "env", "--preset", "hang", "--explain", env=piped, check=0).stdout
    lines = [x.strip() for x in explain.splitlines()]
    for v in presets.get_preset("hang").vars:
        assert v.meaning in lines and f"{v.name}={v.value}" in lines, explain
    listed = areal("doctor", "env", "--list", env=piped, check=0).stdout
    assert "…" not in listed and max(map(len, listed.splitlines())) <= 80, listed
    flat = " ".join(listed.split())
    for name in presets.preset_names():
        p = presets.get_preset(name)
        assert " ".join(p.description.split()) in flat
        assert " ".join(v.name for v in p.vars) in flat
    # The hang preset sets both names of the flight recorder, and says so.
    hang = presets.get_preset("hang")
    assert {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} <= set(hang.env())
    assert "under both its names" in hang.description


def test_the_manual_s_loose_ends_agree_with_what_runs(areal_env):
    # doctor mesh: a dimension of size 1 is named, not silently missing.
    head = areal("doctor", "mesh", "--alloc", "fsdp:d2t2", check=0).stdout.splitlines()[0]
    assert "dp, tp" in head and "pp=1, cp=1: size 1, not in the mesh" in head
    head = areal("doctor", "mesh", "--alloc", "fsdp:d2c2t2", check=0).stdout.splitlines()
    assert head[1].split()[:4] == ["rank", "dp", "cp", "tp"]
    # logs --role: every role the log reader knows, the watchdog's included (its hint).
    from areal_cli.logfiles import ROLES

    help_ = " ".join(areal("logs", "--help", check=0).stdout.split())
    assert " | ".join(ROLES) in help_ and "watchdog" in ROLES
    # doctor hang --help: a hang found is exit 0, a dump that failed 1.
    help_ = " ".join(areal("doctor", "hang", "--help", check=0).stdout.split())
    assert "0 a verdict was reached, a hang found included" in help_
    assert "1 a rank could not be dumped" in help_
