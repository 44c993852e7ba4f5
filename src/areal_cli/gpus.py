"""Which GPUs this host offers: `--gpus`, else CUDA_VISIBLE_DEVICES, else nvidia-smi."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from areal_cli.errors import UsageError

NVIDIA_SMI_QUERY = [
    "--query-gpu=index,uuid,name,memory.total,memory.used",
    "--format=csv,noheader,nounits",
]


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str = ""
    uuid: str = ""
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    # How CUDA_VISIBLE_DEVICES names it for children: the index, or the GPU-/MIG- UUID when
    # that is how the parent's CUDA_VISIBLE_DEVICES named it.
    token: str | None = None


@dataclass(frozen=True)
class GpuInventory:
    gpus: tuple[Gpu, ...]
    source: str  # "--gpus" | "CUDA_VISIBLE_DEVICES" | "nvidia-smi" | "none"

    @property
    def ids(self) -> list[int]:
        return [g.index for g in self.gpus]

    def visible(self, ids: list[int]) -> str:
        """CUDA_VISIBLE_DEVICES for a child that gets these GPUs."""
        by_index = {g.index: g.token or str(g.index) for g in self.gpus}
        return ",".join(by_index[i] for i in ids)


def parse_gpu_list(text: str, source: str = "--gpus") -> list[int]:
    text = text.strip()
    if text in ("", "-1", "none"):
        return []
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part and part[0] != "-":
            lo, _, hi = part.partition("-")
            if lo.isdigit() and hi.isdigit() and int(lo) <= int(hi):
                ids.extend(range(int(lo), int(hi) + 1))
                continue
        if not part.isdigit():
            raise UsageError(
                f"{source}: {part!r} is not a GPU index",
                hint="write indices separated by commas, e.g. 0,1,2,3 or a range 0-3",
            )
        ids.append(int(part))
    if len(set(ids)) != len(ids):
        raise UsageError(f"{source}: GPU listed twice in {text!r}")
    return ids


def query_nvidia_smi() -> list[Gpu]:
    """GPUs as nvidia-smi reports them; [] when it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        res = subprocess.run(
            [exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if res.returncode != 0:
        return []
    return parse_nvidia_smi_csv(res.stdout)


COMPUTE_APPS_QUERY = [
    "--query-compute-apps=gpu_uuid,pid,used_memory",
    "--format=csv,noheader,nounits",
]


def busy(inventory: GpuInventory) -> dict[int, str]:
    """GPUs of this inventory that nvidia-smi shows a compute process on (anyone's: other
    users' servers and trainers count), index → who."""
    exe = shutil.which("nvidia-smi")
    if not exe or not inventory.gpus:
        return {}
    try:
        res = subprocess.run(
            [exe, *COMPUTE_APPS_QUERY], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if res.returncode != 0:
        return {}
    by_uuid = {g.uuid: g.index for g in inventory.gpus if g.uuid}
    if not by_uuid:
        # An inventory from --gpus or CUDA_VISIBLE_DEVICES indices: nvidia-smi names the uuids.
        by_uuid = {g.uuid: g.index for g in query_nvidia_smi()}
    out: dict[int, str] = {}
    for line in res.stdout.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 2 or cols[0] not in by_uuid or not cols[1].isdigit():
            continue
        mem = f", {cols[2]} MiB" if len(cols) > 2 and cols[2].isdigit() else ""
        out.setdefault(by_uuid[cols[0]], f"pid {cols[1]} (a GPU process{mem})")
    return out


def parse_nvidia_smi_csv(text: str) -> list[Gpu]:
    gpus = []
    for line in text.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 3 or not cols[0].isdigit():
            continue
        gpus.append(
            Gpu(
                index=int(cols[0]),
                uuid=cols[1],
                name=cols[2],
                memory_total_mib=_int(cols[3]) if len(cols) > 3 else None,
                memory_used_mib=_int(cols[4]) if len(cols) > 4 else None,
            )
        )
    return gpus


def detect(gpus_flag: str | None = None) -> GpuInventory:
    if gpus_flag is not None:
        return GpuInventory(tuple(Gpu(i) for i in parse_gpu_list(gpus_flag)), "--gpus")
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        # UUID lists (GPU-xxxx) cannot be sliced by index; treat them positionally.
        if env.strip() and not env.strip()[0].isdigit() and env.strip() not in ("-1",):
            tokens = [x.strip() for x in env.split(",") if x.strip()]
            return GpuInventory(
                tuple(Gpu(i, uuid=t, token=t) for i, t in enumerate(tokens)),
                "CUDA_VISIBLE_DEVICES",
            )
        return GpuInventory(
            tuple(Gpu(i) for i in parse_gpu_list(env, "CUDA_VISIBLE_DEVICES")),
            "CUDA_VISIBLE_DEVICES",
        )
    found = query_nvidia_smi()
    if found:
        return GpuInventory(tuple(found), "nvidia-smi")
    return GpuInventory((), "none")


def _int(s: str) -> int | None:
    try:
        return int(float(s))
    except ValueError:
        return None
