"""A SIGKILLed server back in rotation, minus the server's own start time. Target ≤ 2 s.

`areal serve --backend hf` of a tiny model, one replica, whose weights a trainer's client
moved to version 1 (a disk update). Its engine process is SIGKILLed; the client keeps
asking for generations as a trainer's rollouts do; once it finds the server restarted (back
at its base weights) it realigns it (the same disk update, as the trainer's next sync does)
and the server is back in rotation when it answers a generation at version 1. Its own start
time: the same engine command, started directly here, until its /health answers (polled
every 5 ms), the faster of two runs. The overhead is what the restart adds: noticing the
exit, leaving discovery, the backoff, reaping, waiting for readiness, registering, and the
client's recheck and realignment.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import AREAL, free_port, healthy, loadavg, report

from areal_cli.modelgen import create_tiny_model

TARGET = 2.0


def own_start(argv: list[str], env: dict) -> float:
    """Seconds from starting the engine's command to its first healthy answer."""
    port = free_port()
    argv = [*argv]
    argv[argv.index("--port") + 1] = str(port)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not healthy(port):
            if proc.poll() is not None:
                sys.exit(f"the engine exited with {proc.returncode}: {argv}")
            time.sleep(0.005)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait()


def back_in_rotation(model: Path, env: dict) -> float:
    """Seconds from the SIGKILL to a generation at the trainer's version from the server."""
    from areal_cli.worker.rollout import RolloutClient, RolloutError

    out = subprocess.run([AREAL, "serve", "--backend", "hf", "--model", str(model), "--detach",
                          "--json", "--api-key", "none"], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    (server,) = json.loads(out.stdout)["servers"]
    client = RolloutClient([server["addr"]], backend="hf", cooldown=0.05, retry_backoff=0.01)
    try:
        client.run(client.update_weights_from_disk(str(model), version="1"))
        assert client.run(client.generate([1, 2, 3], max_new_tokens=1)).weight_version == "1"
        t0 = time.perf_counter()
        os.kill(server["pid"], 9)
        while True:
            state = client.pool[0]
            if state.reset:  # found restarted: the trainer's sync realigns it
                client.run(client.update_weights_from_disk(str(model), version="1"))
            try:
                done = client.run(client.generate([1, 2, 3], max_new_tokens=1))
            except RolloutError:
                time.sleep(0.005)
                continue
            if done.weight_version == "1":
                return time.perf_counter() - t0
            sys.exit(f"a generation at version {done.weight_version} reached the trainer")
    finally:
        client.close_sync()
        subprocess.run([AREAL, "stop", "default/trial0"], env=env, capture_output=True)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(Path(tmp) / "tiny", seed=0)
        env = {**os.environ, "AREAL_HOME": f"{tmp}/home", "AREAL_REGISTRY": f"{tmp}/reg"}
        plan = json.loads(subprocess.run(
            [AREAL, "serve", "--backend", "hf", "--model", str(model), "--dry-run", "--json",
             "--api-key", "none"],
            env=env, capture_output=True, text=True, check=True).stdout)  # fmt: skip
        (p,) = plan["processes"]
        engine_env = {**os.environ, **p["env"]}
        base = min(own_start(p["argv"], engine_env) for _ in range(2))
        back = back_in_rotation(model, env)
        own = min(base, own_start(p["argv"], engine_env))  # once more, after: the faster
    over = back - own
    print(f"SIGKILL to back in rotation {back:.2f}s, the server's own start {own:.2f}s "
          f"(load {loadavg()})")  # fmt: skip
    ok = report("server_heal_overhead_s", over, f"<= {TARGET:g} s", over <= TARGET)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
