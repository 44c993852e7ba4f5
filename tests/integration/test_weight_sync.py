"""Weight sync over a process group, with real processes: hf servers on loopback, a trainer
(plain python or torchrun with two FSDP ranks over gloo), and the faults that must not hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from areal_cli.modelgen import create_tiny_model
from tests.integration.helpers_server import HfServer, free_port

HERE = Path(__file__).parent
TRAINER = str(HERE / "sync_trainer.py")
PROMPT = [72, 101, 108, 108, 111]
GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "tiny": create_tiny_model(root / "tiny", seed=0),
        # 4M parameters: enough buckets of 64 KiB that a server can die half way.
        "mid": create_tiny_model(
            root / "mid", hidden_size=256, num_layers=4, intermediate_size=1024, seed=0
        ),
    }


def start(model: Path, log_dir: Path, n: int, *args: str) -> list[HfServer]:
    servers = [HfServer(model, log_dir, "--seed", "0", *args) for _ in range(n)]
    for s in servers:
        s.wait_healthy()
    return servers


@pytest.fixture(scope="module")
def tiny_server(models, tmp_path_factory):
    """One server of the tiny model for the tests that leave it running: each sync replaces
    every weight, so no test depends on what an earlier one loaded."""
    (srv,) = start(models["tiny"], tmp_path_factory.mktemp("tiny-server"), 1)
    yield srv
    srv.stop()


def greedy(srv: HfServer) -> list[int]:
    status, body = srv.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert status == 200, body
    return body["output_ids"]


def version(srv: HfServer) -> str:
    return srv.get("/model_info")[1]["weight_version"]


def trainer(model: Path, servers: list[HfServer], *args: str, nproc: int = 1) -> list[str]:
    addrs = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    cmd = [sys.executable, TRAINER, "--model", str(model), "--servers", addrs, *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), *cmd[1:]]  # fmt: skip
    return cmd


def run_trainer(cmd: list[str], timeout: float = 240, **env_extra: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env_extra}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]


def test_distributed_sync_reaches_every_replica_and_reuses_its_group(models, tmp_path):
    servers = start(models["tiny"], tmp_path, 2)
    try:
        before = [greedy(s) for s in servers]
        # By default over gloo (the tiny model's tensors are all small: one flattened bucket),
        # then tensor by tensor, then flattened buckets of everything (what nccl takes): each
        # trainer makes one group and reuses it for its syncs.
        variants = [[], ["--flatten", "none"], ["--flatten", "all"]]
        for run, extra in enumerate(variants, start=1):
            lines = run_trainer(trainer(models["tiny"], servers, "--syncs", "3", *extra))
            assert [x["ok"] for x in lines] == [True, True, True], (extra, lines)
            for s in servers:
                assert version(s) == "3"
                assert greedy(s) == lines[-1]["expected"] != before[0]
                assert s.log().count("init custom process group") == run
                assert s.log().count("weights updated from distributed") == 3 * run
                # A trainer that finished leaves no group and no owner behind.
                info = s.get("/server_info")[1]
                assert info["weight_update"]["groups"] == [] and info["weight_owner"] is None
    finally:
        for s in servers:
            s.stop()


def test_fsdp_ranks_over_torchrun_sync_the_gathered_model(models, tiny_server):
    lines = run_trainer(trainer(models["tiny"], [tiny_server], "--syncs", "2", nproc=2))
    assert [x["ok"] for x in lines] == [True, True], lines
    assert version(tiny_server) == "2" and greedy(tiny_server) == lines[-1]["expected"]


def test_disk_sync_sends_the_version_and_reads_it_back(models, tiny_server, tmp_path):
    cmd = trainer(models["tiny"], [tiny_server], "--method", "disk",
                  "--weights-dir", str(tmp_path / "w"))  # fmt: skip
    (line,) = run_trainer(cmd)
    assert line["ok"] and line["version"] == "1", line
    assert version(tiny_server) == "1" and greedy(tiny_server) == line["expected"]


def test_a_server_killed_mid_broadcast_is_named_and_the_sync_goes_on_without_it(models, tmp_path):
    timeout = 20.0
    a, b = start(models["mid"], tmp_path, 2, "--weight-sync-timeout", "15")
    gate = tmp_path / "go"
    cmd = trainer(models["mid"], [a, b], "--syncs", "2", "--bucket-bytes", str(64 << 10),
                  "--timeout", str(timeout), "--wait-file", str(gate))  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not b.get("/server_info")[1]["weight_update"]["staged_tensors"]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.005)
        os.kill(b.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        first = json.loads(proc.stdout.readline())
        done_after = time.monotonic() - killed
        # It goes on with the survivor, within its timeout, and says which server it lost.
        alive, dead = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
        assert first["ok"] is True and first["servers"] == [alive], first
        assert list(first["failed"]) == [dead] and first["versions"][alive] == "1", first
        assert first["versions"][dead] != "1"
        assert done_after < timeout
        # The survivor holds the new weights, whole (the broken group installed nothing).
        assert version(a) == "1" and greedy(a) == first["expected"]
        gate.touch()
        second = json.loads(proc.stdout.readline())
        assert second["ok"] is True and second["servers"] == [alive], second
        assert version(a) == "2" and greedy(a) == second["expected"]
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        assert f"went on without {dead}" in err, err[-3000:]
    finally:
        proc.kill()
        proc.wait()
        a.stop()
        b.stop()


# Rank 0 driven by hand, to send what a buggy trainer would: the server must answer 400,
# keep its weights, and refuse a second group of the same name.
BAD_SENDER = textwrap.dedent("""
    import json, sys, threading, urllib.request, torch
    from areal_cli.backends import weight_group
    url, name = sys.argv[1], "g1"

    def post(path, body):
        req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def together(path, body, fn):
        out = {}
        t = threading.Thread(target=lambda: out.update(r=post(path, body)))
        t.start(); fn(); t.join()
        return out["r"]

    store = weight_group.listen("127.0.0.1", 2, 30)
    init = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1,
            "world_size": 2, "group_name": name, "backend": "gloo"}
    holder = {}
    def join():
        holder["g"] = weight_group.join(master_address="127.0.0.1", master_port=store.port,
            rank=0, world_size=2, group_name=name, backend="gloo", timeout_s=30, store=store)
    results = {"init": together("/init_weights_update_group", init, join)}
    group = holder["g"]
    results["second_init"] = post("/init_weights_update_group", init)
    results["begin"] = post("/begin_weight_update", {})
    for case, dtype, shape in [("shape", torch.float32, [65]), ("dtype", torch.bfloat16, [64])]:
        t = torch.ones(shape, dtype=dtype)
        body = {"names": ["model.norm.weight"], "dtypes": [str(dtype)[6:]], "shapes": [shape],
                "group_name": name, "load_format": "flattened_bucket", "weight_version": "bad"}
        flat = weight_group.flatten([t])
        results[case] = together("/update_weights_from_distributed", body,
                                 lambda: group.broadcast(flat, 30))
    results["end"] = post("/end_weight_update", {})
    results["destroy"] = post("/destroy_weights_update_group", {"group_name": name})
    print(json.dumps(results))
""")


def test_bad_shapes_and_dtypes_are_refused_and_a_live_group_cannot_be_made_twice(models, tmp_path):
    (srv,) = start(models["tiny"], tmp_path, 1)
    try:
        old = greedy(srv)
        res = subprocess.run([sys.executable, "-c", BAD_SENDER, srv.url], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        r = json.loads(res.stdout.strip().splitlines()[-1])
        assert r["init"] == [
            200,
            {"success": True, "message": "Succeeded to initialize custom process group."},
        ]
        assert r["second_init"][0] == 400
        assert "already been created" in r["second_init"][1]["message"]
        assert r["begin"][0] == 200
        assert r["shape"][0] == 400 and "shape [65]" in r["shape"][1]["message"]
        assert r["dtype"][0] == 400 and "bfloat16" in r["dtype"][1]["message"]
        assert r["end"][0] == 200 and r["destroy"][0] == 200
        assert version(srv) == "default" and greedy(srv) == old
    finally:
        srv.stop()


# A receiver built exactly as SGLang 0.5.23 builds its side of the group
# (srt/utils/common.py:2859-2927, init_custom_process_group: rendezvous at tcp://addr:port,
# PrefixStore(group_name), torch's _new_process_group_helper) and reading the bucket as
# srt/weight_sync/tensor_bucket.py:99-150 does. Our trainer-side group must meet it.
SGLANG_RECEIVER = textwrap.dedent("""
    import datetime, json, sys, torch
    from torch.distributed.distributed_c10d import (Backend, PrefixStore,
        _new_process_group_helper, _world, rendezvous)
    port, name = int(sys.argv[1]), sys.argv[2]
    timeout = datetime.timedelta(seconds=30)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    pg, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), store, group_name=name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(2)}
    sizes = [(torch.float32, (3, 4)), (torch.bfloat16, (5,))]
    nbytes = [torch.Size(s).numel() * d.itemsize for d, s in sizes]
    flat = torch.empty(sum(nbytes), dtype=torch.uint8)
    torch.distributed.broadcast(flat, src=0, group=pg)
    a = flat[: nbytes[0]].view(torch.float32).reshape(3, 4)
    b = flat[nbytes[0]:].view(torch.bfloat16).reshape(5)
    print(json.dumps([a.sum().item(), b.float().sum().item()]), flush=True)
    # The stand-in's own teardown is not under test: gloo may abort ("terminate called
    # without an active exception") when its pairs are torn down while the peer is
    # still connected, so leave without running destructors.
    import os
    os._exit(0)
""")


def test_our_group_meets_sglangs_own_group_helper(tmp_path):
    import torch

    from areal_cli.backends import weight_group

    store = weight_group.listen("127.0.0.1", 2, 30)
    proc = subprocess.Popen(
        [sys.executable, "-c", SGLANG_RECEIVER, str(store.port), "wg"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        group = weight_group.join(master_address="127.0.0.1", master_port=store.port, rank=0,
                                  world_size=2, group_name="wg", backend="gloo", timeout_s=30,
                                  store=store)  # fmt: skip
        a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        b = torch.full((5,), 2.0, dtype=torch.bfloat16)
        group.broadcast(weight_group.flatten([a, b]), 30)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out) == [66.0, 10.0]
        group.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_session_left_open_by_a_dead_trainer_does_not_block_the_next(models, tiny_server):
    srv = tiny_server
    # What a trainer killed between /begin_weight_update and /end_weight_update leaves.
    assert srv.post("/begin_weight_update", {})[0] == 200
    (line,) = run_trainer(trainer(models["tiny"], [srv]))
    assert line["ok"], line
    assert version(srv) == "1" and greedy(srv) == line["expected"]


def test_a_server_hung_mid_broadcast_costs_stall_plus_probe_and_the_sync_goes_on(models, tmp_path):
    """SIGSTOP in the middle of the broadcast: rank 0 must not sit in the group's teardown
    (gloo's abort waits for the blocked broadcast) for the whole timeout."""
    stall, probe, timeout = 2.0, 2.0, 60.0
    a, b = start(models["mid"], tmp_path, 2, "--weight-sync-timeout", "60")
    cmd = trainer(models["mid"], [a, b], "--timeout", str(timeout), "--stall-timeout", str(stall),
                  "--probe-timeout", str(probe))  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stopped = psutil.Process(b.proc.pid)
    try:
        deadline = time.monotonic() + 120
        # One bucket of the whole model: the hang lands inside its broadcast.
        while not b.get("/server_info")[1]["weight_update"]["receiving"]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.002)
        stopped.suspend()
        hung_at = time.monotonic()
        line = json.loads(proc.stdout.readline())
        took = time.monotonic() - hung_at
        alive, hung = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
        assert line["ok"] is True and line["servers"] == [alive], (line, a.log()[-2000:])
        assert list(line["failed"]) == [hung] and "stopped answering" in line["failed"][hung]
        assert took <= stall + probe + 5, took
        assert version(a) == "1" and greedy(a) == line["expected"]
        print(f"\nserver hung mid-broadcast: the sync went on without it after {took:.1f}s")
        assert proc.wait(60) == 0
    finally:
        if stopped.is_running():
            stopped.resume()
        proc.kill()
        proc.wait()
        a.stop()
        b.stop()


# Rank 0 opened as SGLang's helper opens it (what verl's and slime's trainers call): torch's
# tcp:// rendezvous, whose master waits for every worker's store to check in.
SGLANG_TRAINER = textwrap.dedent("""
    import datetime, json, os, sys, threading, urllib.request, torch
    from torch.distributed.distributed_c10d import (Backend, PrefixStore,
        _new_process_group_helper, _world, rendezvous)
    url, port, name = sys.argv[1], int(sys.argv[2]), "sg"
    timeout = datetime.timedelta(seconds=15)

    def post(path, body):
        req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    out = {}
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": name, "backend": "gloo"}
    t = threading.Thread(target=lambda: out.update(init=post("/init_weights_update_group", init)))
    t.start()
    try:
        store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
        store = PrefixStore(name, store)
        pg, _ = _new_process_group_helper(2, 0, [], Backend("gloo"), store, group_name=name,
                                          backend_options=None, timeout=timeout)
        out["joined"] = True
    except Exception as e:
        out["joined"] = str(e)
    t.join()
    out["destroy"] = post("/destroy_weights_update_group", {"group_name": name})
    print(json.dumps(out), flush=True)
    os._exit(0)
""")


def test_a_trainer_opening_the_group_as_sglangs_helper_does_meets_our_server(tiny_server):
    res = subprocess.run([sys.executable, "-c", SGLANG_TRAINER, tiny_server.url, str(free_port())],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["joined"] is True, out
    assert out["init"][0] == 200 and out["init"][1]["success"] is True, out
    assert out["destroy"][0] == 200, out


# Inside a network namespace of its own (the test's private loopback): a server, a trainer
# whose HTTP connection is open, then every other ephemeral port taken, then a sync.
NO_PORTS = textwrap.dedent("""
    import json, socket, subprocess, sys, time, urllib.request
    from pathlib import Path
    model = sys.argv[1]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    server = subprocess.Popen([sys.executable, "-m", "areal_cli.server", "--model-path", model,
                               "--port", "8000"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):
            try:
                if urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        import torch
        from transformers import AutoModelForCausalLM
        from areal_cli.worker import sync_weights
        from areal_cli.worker.rollout import RolloutClient
        client = RolloutClient(["127.0.0.1:8000"], backend="hf", retries=0)
        client.run(client.server_info("127.0.0.1:8000"))  # its connection stays open
        Path("/proc/sys/net/ipv4/ip_local_port_range").write_text("61000 61007")
        held = []
        for port in range(61000, 61008):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port)); s.listen(); held.append(s)
            except OSError:
                s.close()
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        try:
            sync_weights(model, client, version=1, timeout=20)
            print(json.dumps({"ok": True}))
        except Exception as e:
            print(json.dumps({"ok": False, "type": type(e).__name__, "error": str(e),
                              "hint": getattr(e, "hint", None)}))
        client.close_sync()
    finally:
        server.kill()
        server.wait()
""")


def test_sync_with_no_ephemeral_port_left_says_what_ran_out(models):
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no network namespace here: {probe.stderr.decode().strip()}")
    res = subprocess.run(["unshare", "-rn", sys.executable, "-c", NO_PORTS, str(models["tiny"])],
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ok"] is False and out["type"] == "RolloutError", out
    assert "EADDRINUSE" in out["error"] and "ephemeral ports (61000-61007)" in out["error"], out
    assert "ip_local_port_range" in out["hint"] and "disk" in out["hint"], out


def test_a_sync_every_server_refuses_names_each_answer_and_resumes_them(models, tmp_path):
    """A trainer of another model: both servers answer 400. The error names each with its
    answer, and neither stays paused."""
    servers = start(models["tiny"], tmp_path, 2)
    try:
        (line,) = run_trainer(trainer(models["mid"], servers, "--timeout", "30"))
        assert line["ok"] is False, line
        for s in servers:
            assert f"127.0.0.1:{s.port}: " in line["error"], line
        assert "served model" in line["error"] and "Set of Tasks" not in line["error"], line
        print(f"\nrefused by every server in {line['seconds']:.2f}s: {line['error'][:300]}")
        for s in servers:
            assert s.get("/server_info")[1]["batching"]["paused"] is False
            assert greedy(s) and version(s) == "default"
    finally:
        for s in servers:
            s.stop()


# "sglang": the trainer sees no instance id, as SGLang reports none; the server's answer for a
# group it does not know tells it.
@pytest.mark.parametrize("told_by", ["instance id", "sglang"])
def test_a_server_restarted_between_syncs_is_noticed_and_gets_the_weights(
    models, tmp_path, told_by
):
    srv = HfServer(models["tiny"], tmp_path, "--seed", "0")
    srv.wait_healthy()
    gate = tmp_path / "go"
    extra = ["--no-instance-id"] if told_by == "sglang" else []
    cmd = trainer(models["tiny"], [srv], "--syncs", "2", "--wait-file", str(gate), *extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = json.loads(proc.stdout.readline())
        assert first["ok"] and version(srv) == "1", first
        srv.stop()
        srv = HfServer(models["tiny"], tmp_path, "--seed", "0", port=srv.port)
        srv.wait_healthy()
        assert version(srv) == "default"
        gate.touch()
        second = json.loads(proc.stdout.readline())
        assert second["ok"] and second["servers"] == [f"127.0.0.1:{srv.port}"], second
        assert version(srv) == "2" and greedy(srv) == second["expected"]
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        why = "no longer knows the weight-update group" if extra else "another server instance"
        assert "was restarted since the last weight sync" in err and why in err, err[-3000:]
        print(f"\nrestarted server: the next sync took {second['seconds']:.2f}s")
    finally:
        proc.kill()
        proc.wait()
        srv.stop()


def test_one_trainer_owns_a_servers_weights_and_the_second_is_refused_at_once(models, tmp_path):
    (srv,) = start(models["tiny"], tmp_path, 1)
    gate = tmp_path / "go"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AREAL_EXPERIMENT": "exp-a", "AREAL_TRIAL": "t1"}
    cmd = trainer(models["tiny"], [srv], "--syncs", "2", "--wait-file", str(gate))
    owner = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)  # fmt: skip
    try:
        assert json.loads(owner.stdout.readline())["ok"]
        # Another trial's trainer: refused at its first request, naming the owner.
        (other,) = run_trainer(trainer(models["tiny"], [srv]), AREAL_EXPERIMENT="exp-b")
        assert other["ok"] is False and other["seconds"] < 10, other
        assert "another trainer, exp-a/t1 (pid" in other["error"], other
        print(f"\nsecond trainer refused after {other['seconds']:.2f}s: {other['error'][:200]}")
        assert srv.get("/server_info")[1]["batching"]["paused"] is False
        gate.touch()
        assert json.loads(owner.stdout.readline())["ok"] and version(srv) == "2"
        assert owner.wait(60) == 0
        # The owner finished: its ownership went with it.
        (other,) = run_trainer(trainer(models["tiny"], [srv]), AREAL_EXPERIMENT="exp-b")
        assert other["ok"] and version(srv) == "1", other
        # An owner that dies without a word (SIGKILL) holds nothing either.
        gate.unlink()
        killed = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env=env)  # fmt: skip
        assert json.loads(killed.stdout.readline())["ok"]
        killed.kill()
        killed.wait()
        (other,) = run_trainer(trainer(models["tiny"], [srv]), AREAL_EXPERIMENT="exp-b")
        assert other["ok"], other
        assert "its process" in srv.log() and "is gone" in srv.log()
    finally:
        owner.kill()
        owner.wait()
        srv.stop()


# A script that syncs and ends without closing its client.
NO_CLOSE = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM
    from areal_cli.worker import sync_weights
    from areal_cli.worker.rollout import RolloutClient
    client = RolloutClient([sys.argv[1]], backend="hf")
    model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
    print(sync_weights(model, client, version=1)["servers"], flush=True)
""")


def test_a_trainer_that_ends_without_closing_leaves_no_group_or_owner(models, tiny_server):
    addr = f"127.0.0.1:{tiny_server.port}"
    res = subprocess.run([sys.executable, "-c", NO_CLOSE, addr, str(models["tiny"])],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert res.returncode == 0 and addr in res.stdout, res.stderr[-3000:]
    info = tiny_server.get("/server_info")[1]
    assert info["weight_update"]["groups"] == [] and info["weight_owner"] is None, info
    assert version(tiny_server) == "1"
