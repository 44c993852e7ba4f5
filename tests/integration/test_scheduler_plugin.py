"""A scheduler and a registry from outside areal: tests/plugins/toy_plugin, made in each test
into a real installed distribution (a dist-info with its entry points, on PYTHONPATH), and
found through those entry points alone. `areal serve`, `train`, `ps`, `doctor hang` and `stop`
run on the toy scheduler, servers register in and trainers discover through the toy
registry (scheme toy://), with no line of areal naming either.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from areal_cli import procs
from tests.helpers import FAKE_PYTHON, REPO, areal, wait_for
from tests.plugins import dist

TOY = {
    "areal_cli.schedulers": {
        "toy": "toy_plugin.scheduler:ToyScheduler",
        "toyish": "toy_plugin.scheduler:ToyScheduler",  # an alias
    },
    "areal_cli.registries": {"toy": "toy_plugin.registry:ToyRegistry"},
}


def installed(root: Path, name: str = "toy-plugin", entry_points=None, packages=("toy_plugin",)):
    """The environment of a shell where distribution `name` is installed under `root`."""
    dist.make(root, name, TOY if entry_points is None else entry_points, packages)
    path = [str(root), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, path))}


def test_a_plugin_distribution_serves_trains_lists_diagnoses_and_stops(tmp_path, areal_env):
    from areal_cli.modelgen import create_tiny_model

    model = create_tiny_model(tmp_path / "tiny")
    registry = tmp_path / "toyreg"
    env = {**installed(tmp_path / "site"), "AREAL_REGISTRY": f"toy://{registry}"}
    res = areal("serve", "--scheduler", "toy", "--scheduler-opt", "note=hello", "--backend",
                "hf", "--model", str(model), "--alloc", "hf:d1", "--python", FAKE_PYTHON,
                "--detach", "--json", env=env, check=0, timeout=120)  # fmt: skip
    served = json.loads(res.stdout)
    assert served["scheduler"] == "toy" and len(served["servers"]) == 1
    audit = Path(f"{registry}.audit")
    assert " put " in audit.read_text()  # the replica runner registered through the toy
    # An option the toy does not declare is refused, naming the ones it has.
    bad = areal("serve", "--scheduler", "toyish", "--partition", "gpu", "--backend", "hf",
                "--model", str(model), env=env, check=2)  # fmt: skip
    assert "--partition: not an option of the toy scheduler" in bad.stderr and "note" in bad.stderr

    script = REPO / "tests" / "plugins" / "toy_plugin" / "train_hang.py"
    reads_before = audit.read_text().count(" read ")
    trained = areal("train", "--scheduler", "toyish", "--alloc", "fsdp:d2", "--detach",
                    str(script), env=env, check=0, timeout=120)  # fmt: skip
    assert "Traceback" not in trained.stderr
    out = next(areal_env[0].glob("logs/*/default/trial0")) / "torchrun.log"
    wait_for(lambda: out.exists() and all(f"rank {r}: ready" in out.read_text() for r in (0, 1)),
             120, f"both ranks found the servers: {out.read_text() if out.exists() else ''}")  # fmt: skip
    assert audit.read_text().count(" read ") > reads_before  # discovery read the toy

    jobs = json.loads(areal("ps", "--json", env=env, check=0).stdout)
    assert sorted((j["scheduler"], j["kind"]) for j in jobs) == [
        ("toy", "serve"), ("toy", "train")
    ]  # fmt: skip
    serve_job = next(j for j in jobs if j["kind"] == "serve")
    assert serve_job["message"] == "note: hello" and all(s["healthy"] for s in serve_job["servers"])

    hang = areal("doctor", "hang", "--job", "default/trial0", "--interval", "0.2", "--json",
                 env=env, timeout=180)  # fmt: skip
    assert hang.returncode in (0, 1), hang.stderr
    verdict = json.loads(hang.stdout)["verdict"]
    assert verdict["kind"] == "mismatched_collective" and verdict["odd_ranks"] == [1]

    stop = areal("stop", "default/trial0", env=env, check=0)
    assert "stopped" in stop.stdout
    assert procs.find_marked(served["marker"]) == []
    assert all(
        j["state"] == "stopped"
        for j in json.loads(areal("ps", "--all", "--json", env=env, check=0).stdout)
    )


def test_a_plugin_is_seen_by_ps_and_stop_in_a_shell_that_never_ran_it(tmp_path, areal_env):
    # Records of the toy in a home where nothing marked it used: ps asks every scheduler
    # whose records folder is there, the toy's own folder included.
    env = installed(tmp_path / "site")
    rec = areal_env[0] / "toy" / "e" / "t" / "serve.json"
    rec.parent.mkdir(parents=True)
    rec.write_text(json.dumps({
        "experiment": "e", "trial": "t", "kind": "serve", "marker": "areal-e-t-0123456789",
        "pids": [], "started": 1.0, "state": "stopped", "log_dir": str(tmp_path),
        "registry": str(areal_env[1]), "note": None, "model": "m",
    }))  # fmt: skip
    (job,) = json.loads(areal("ps", "--all", "--json", env=env, check=0).stdout)
    assert job["scheduler"] == "toy" and job["state"] == "stopped"
    stop = areal("stop", "e/t", env=env, check=0)
    assert "Traceback" not in stop.stderr


def test_names_and_aliases_are_listed_in_one_usage_error(tmp_path, areal_env):
    env = installed(tmp_path / "site")
    res = areal("serve", "--scheduler", "nope", "--backend", "hf", "--model", "m",
                "--dry-run", env=env, check=2)  # fmt: skip
    assert "unknown scheduler 'nope'" in res.stderr
    assert "toy or toyish" in res.stderr and "local" in res.stderr and "slurm" in res.stderr
    bad = areal("serve", "--backend", "hf", "--model", "m", "--dry-run",
                env={**env, "AREAL_REGISTRY": "nope://x"}, check=2)  # fmt: skip
    assert "unknown registry scheme 'nope'" in bad.stderr and "toy" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("target", ["os:system", "json:JSONDecodeError", "os:sep"])
def test_an_entry_that_is_not_a_scheduler_class_is_refused_naming_it(target, tmp_path, areal_env):
    # A function, a class of another kind, a plain value: each a clear exit 2, never the
    # TypeError of calling it with the scheduler's options.
    env = installed(tmp_path / "site", "mine", {"areal_cli.schedulers": {"mine": target}}, ())
    for args in (("stop", "e/t"), ("serve", "--scheduler", "mine", "--backend", "hf",
                                    "--model", "m", "--dry-run")):  # fmt: skip
        res = areal(*args, env=env, check=2)
        assert "Traceback" not in res.stderr
        assert f"scheduler 'mine' (entry point mine = {target} of mine-0.1)" in res.stderr
        assert "is not a scheduler class" in res.stderr


def test_an_entry_whose_module_fails_to_import_is_refused_naming_it(tmp_path, areal_env):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "broken_sched.py").write_text("raise RuntimeError('no cluster here')\n")
    env = installed(tmp_path / "site", "broken", {"areal_cli.schedulers": {"b": "broken_sched:X"}},
                    ())  # fmt: skip
    res = areal("stop", "e/t", env=env, check=2)
    assert "Traceback" not in res.stderr
    assert "scheduler 'b' (entry point b = broken_sched:X of broken-0.1)" in res.stderr
    assert "RuntimeError: no cluster here" in res.stderr


def test_a_plugin_replacing_a_built_in_name_says_so_in_one_line(tmp_path, areal_env):
    home = areal_env[0]
    (home / "jobs").mkdir(parents=True)  # so that `ps` loads the local scheduler
    toy = TOY["areal_cli.schedulers"]["toy"]
    env = installed(tmp_path / "site", "site-local", {"areal_cli.schedulers": {"local": toy}})
    res = areal("ps", env=env, check=0)
    warned = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert warned == [
        f"warning: scheduler 'local': site_local-0.1's {toy} replaces "
        f"areal_cli-0.1.0's areal_cli.schedulers.local:LocalScheduler"
    ], res.stderr
    # A new name replaces nothing: no warning.
    quiet = areal("ps", env=installed(tmp_path / "other"), check=0)
    assert "warning" not in quiet.stderr, quiet.stderr
