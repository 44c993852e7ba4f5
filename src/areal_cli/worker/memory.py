"""The doctor's memory requests, answered by a rank's channel thread.

memory            torch's CUDA allocator: allocated, reserved and peak bytes per device
                  this rank uses (None on a rank without CUDA)
memory_snapshot   torch.cuda.memory._dump_snapshot(path): the allocator's segments and
                  blocks (with stacks of allocations made since history recording began),
                  the pickle pytorch.org/memory_viz reads; recording is switched on here
                  when it was off, so a second snapshot shows where blocks came from
"""

from __future__ import annotations

import os
import sys

from areal_cli.worker import channel


def _cuda():
    torch = sys.modules.get("torch")  # the rank has it loaded, or it holds no CUDA memory
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch


def _memory(_req: dict) -> dict:
    torch = _cuda()
    out: dict = {"pid": os.getpid(), "rank": channel._env_int("RANK"), "cuda": None}
    if torch is None:
        return out
    dev = torch.cuda.current_device()
    out["cuda"] = {
        "device": dev,
        "name": torch.cuda.get_device_name(dev),
        "allocated": torch.cuda.memory_allocated(dev),
        "reserved": torch.cuda.memory_reserved(dev),
        "peak_allocated": torch.cuda.max_memory_allocated(dev),
        "peak_reserved": torch.cuda.max_memory_reserved(dev),
        "total": torch.cuda.get_device_properties(dev).total_memory,
    }
    return out


_RECORDING = False


def _snapshot(req: dict) -> dict:
    global _RECORDING
    torch = _cuda()
    if torch is None:
        return {"written": None, "reason": "this rank uses no CUDA memory"}
    path = str(req["path"])
    torch.cuda.memory._dump_snapshot(path)
    started = False
    if not _RECORDING:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        _RECORDING = started = True
    return {"written": path, "history_started": started}


channel.register("memory", _memory)
channel.register("memory_snapshot", _snapshot)
