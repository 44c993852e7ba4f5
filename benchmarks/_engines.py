"""The real engines' CPU builds (`make engines`) for the benchmarks that compare against them:
where the build is, and one SGLang server under `areal serve --detach` for a `with` block.

    with sglang_server(model, root) as addr:   # "127.0.0.1:PORT", no API key
        ...
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

AREAL = str(Path(sys.executable).parent / "areal")


def sglang_python() -> str | None:
    """The SGLang CPU build's interpreter, or None when it is not built here."""
    root = Path(os.environ.get("AREAL_ENGINES", "/var/cache/areal-engines")) / "sglang"
    py = root / "bin" / "python"
    return str(py) if py.exists() and (root / ".areal-engine").exists() else None


@contextlib.contextmanager
def sglang_server(model: Path, root: Path, trial: str = "bench") -> Iterator[str]:
    """One SGLang replica serving `model`, without an API key, as job default/TRIAL-PID;
    stopped (areal stop) after."""
    python = sglang_python()
    if python is None:
        raise SystemExit("no SGLang build (`make engines`)")
    # The user's own AREAL_HOME, where a first serve remembered that this interpreter's
    # engine runs on CPU (that check imports torch: minutes on a loaded host); a registry of
    # the run's own, and a trial no other run uses.
    env = {**os.environ, "AREAL_REGISTRY": str(root / "reg"), "CUDA_VISIBLE_DEVICES": "",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    env.pop("OMP_NUM_THREADS", None)
    trial = f"{trial}-{os.getpid()}"
    t0 = time.perf_counter()
    res = subprocess.run([AREAL, "serve", "--backend", "sglang", "--model", str(model),
                          "--python", python, "--api-key", "none", "--trial", trial,
                          "--detach", "--json"], env=env, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    try:
        if res.returncode != 0:
            raise SystemExit(f"areal serve --backend sglang failed:\n{res.stderr[-3000:]}")
        addr = json.loads(res.stdout)["servers"][0]["addr"]
        print(f"  SGLang {addr} ready in {time.perf_counter() - t0:.1f} s", flush=True)
        yield addr
    finally:
        subprocess.run([AREAL, "stop", f"default/{trial}"], env=env, capture_output=True,
                       timeout=120)  # fmt: skip
