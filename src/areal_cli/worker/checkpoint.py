"""Training checkpoints: save and restore what a run needs to go on after it died.

    ckpt = Checkpointer(keep=2)                     # every rank, at the same point
    got = ckpt.load(model, optimizer)               # the latest whole checkpoint, or None
    step = got.step if got else 0
    ...
    ckpt.save(step + 1, model, optimizer, extra={"data": position})   # returns at once
    ...
    ckpt.close()                                    # waits for the save in flight

What is saved, with `torch.distributed.checkpoint` (DCP): the model and optimizer as the
sharded state dicts of `get_state_dict` (each rank writes its own shards of an FSDP2 model;
a run with another number of ranks can load them), every rank's RNG states (Python, NumPy,
torch CPU, CUDA when present), the step, and `extra`: what the script needs to go on (the
data position, the weight version it pushed).

Whole or absent: a checkpoint is written into `<dir>/.step-N.tmp`; when every rank has
written (DCP's last collective: rank 0 writes the metadata only after all ranks reported
their writes), rank 0 puts a marker in it and renames it to `<dir>/step-N`. A job killed
during a save leaves the `.tmp` folder, which nobody reads and the next Checkpointer
removes; `latest()` returns the newest folder that has its marker. The newest `keep` are
kept. Folders are 0700 and files 0600: the weights are the user's.

In the background (`save(..., background=True)`, the default), what DCP's `async_save` does
with its thread executor, with two changes: the state is copied to CPU memory during the call,
so the next optimizer step cannot change what is written (on CUDA by DCP's DefaultStager into
pinned buffers it reuses; CPU tensors are cloned, five times faster than the stager's deep
copy: 20 ms against 100 ms for a rank's 19 MB, measured); then a thread of the Checkpointer's
own runs `dcp.save` on the copy, makes it whole and meets the other ranks' threads, so that
on every rank a finished save means a whole checkpoint (DCP's own thread would leave the
rename to a callback that the waiting rank does not wait for). Its collectives go over a gloo
group of the Checkpointer's own, so they never interleave with the training's. One save is in
flight at a time: the next save (or `wait()`, `load()`, `close()`) waits for the previous one.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli import files
from areal_cli.errors import UsageError
from areal_cli.worker import context

if TYPE_CHECKING:
    import torch

log = logging.getLogger("areal.worker")

MARKER = "checkpoint.json"  # rank 0 writes it last, before the rename
_NAME = re.compile(r"^step-(\d+)$")
# A save that died, or a removal that did.
_TMP = re.compile(r"^\.step-\d+(\.tmp|\.removing\.\d+)$")
_RNG_KEY = "rng.rank{}"


@dataclass
class Checkpoint:
    """A whole checkpoint on disk."""

    path: Path
    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    saved_at: float = 0.0
    world_size: int = 0


def default_dir() -> Path:
    """Where a job keeps its checkpoints unless told otherwise: `checkpoints/` in the job's
    own folder (AREAL_LOG_DIR: `<AREAL_HOME>/logs/<user>/<experiment>/<trial>` under `areal
    train`), so a job started again under the same experiment and trial finds them, two
    trials never share them, and every node sees them where it sees the job's logs."""
    if context.CURRENT is not None:
        return context.CURRENT.log_dir / "checkpoints"
    return Path(os.environ.get("AREAL_LOG_DIR") or Path.cwd() / "areal-logs") / "checkpoints"


def _read(path: Path) -> Checkpoint | None:
    m = _NAME.match(path.name)
    if m is None or not path.is_dir():
        return None
    try:
        meta = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None  # not ours, or not whole
    if not (path / ".metadata").is_file():
        return None
    return Checkpoint(
        path=path,
        step=int(m.group(1)),
        extra=meta.get("extra") or {},
        saved_at=float(meta.get("saved_at") or 0.0),
        world_size=int(meta.get("world_size") or 0),
    )


def checkpoints(root: str | Path) -> list[Checkpoint]:
    """The whole checkpoints under `root`, oldest step first."""
    root = Path(root)
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    found = [c for c in map(_read, entries) if c is not None]
    return sorted(found, key=lambda c: c.step)


def latest(root: str | Path) -> Checkpoint | None:
    """The newest whole checkpoint under `root`; None when there is none."""
    found = checkpoints(root)
    return found[-1] if found else None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _rng_state() -> bytes:
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return pickle.dumps(state)


def _set_rng_state(raw: bytes) -> None:
    import torch

    # Our own file, in a folder only this user can write (checked when it was opened).
    state = pickle.loads(raw)  # noqa: S301
    random.setstate(state["python"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "numpy" in state:
        try:
            import numpy as np

            np.random.set_state(state["numpy"])
        except ImportError:
            pass
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(
                [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in cuda]
            )


def _as_tensor(raw: bytes) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class Checkpointer:
    """Saves and restores a training state under one folder (see the module's docstring).

    Collective: every rank makes it at the same point of the script (it makes a process
    group), and calls `save`, `load` and `close` at the same steps. `root`: the folder
    (default `default_dir()`); `keep`: how many whole checkpoints to keep (>= 1); `planner`:
    a DCP SavePlanner for every save (default DCP's own).
    """

    def __init__(
        self, root: str | Path | None = None, *, keep: int = 2, planner: Any = None
    ) -> None:
        import torch.distributed as dist

        if keep < 1:
            raise UsageError(f"keep={keep}: a checkpointer keeps at least one checkpoint")
        self.root = Path(root) if root is not None else default_dir()
        self.keep = keep
        self.planner = planner
        self.rank = _rank()
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        try:
            files.private_dir(self.root)
        except OSError as e:
            raise UsageError(
                f"cannot create the checkpoint folder {self.root}: {e.strerror or e}",
                hint="pick a writable folder (checkpoint_dir)",
            ) from None
        # The background writer's collectives on the training's group would interleave with
        # the training's own; on a gloo group of their own they cannot.
        self._pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: Future | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stager: Any = None
        if self.rank == 0:
            self._remove_leftovers()
        self._barrier()

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        extra: dict[str, Any] | None = None,
        background: bool = True,
    ) -> Path:
        """Save the state after `step` steps as `<root>/step-<step>`; returns that path. With
        `background`, returns once the state is copied to CPU memory; the checkpoint is whole
        (and `latest()` returns it) once the files are written. `extra` must be JSON."""
        self.wait()
        meta = json.dumps(
            {
                "step": step,
                "extra": extra or {},
                "saved_at": time.time(),
                "world_size": self.world_size,
            }
        )
        final = self.root / f"step-{step}"
        tmp = self.root / f".step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that died
        self._barrier()
        files.private_dir(tmp)
        state = self._state(model, optimizer)
        state[_RNG_KEY.format(self.rank)] = _as_tensor(_rng_state())
        if not background:
            self._write(state, tmp, final, meta)
            return final
        if self._pool is None:
            if _cuda():
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                self._stager = DefaultStager(StagingOptions(True, False, False, False))
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="areal-checkpoint")
        staged = self._stager.stage(state) if self._stager is not None else _clone(state)
        self._pending = self._pool.submit(self._write, staged, tmp, final, meta)
        return final

    def wait(self) -> None:
        """Wait until the save in flight (if any) is whole; raise what made it fail."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()

    def _state(self, model: Any, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _write(self, state: dict[str, Any], tmp: Path, final: Path, meta: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(tmp), planner=self.planner, process_group=self._pg)
        try:
            self._finish(tmp, final, meta)
        finally:
            # Every rank returns once the checkpoint is whole (or rank 0 failed to make it so,
            # which its wait() raises): a rank may then read it.
            self._barrier()

    def _finish(self, tmp: Path, final: Path, meta: str) -> None:
        """Every rank has written (DCP's save returns only then): rank 0 makes it whole."""
        if self.rank != 0:
            return
        for dirpath, _, names in os.walk(tmp):
            for name in names:
                os.chmod(os.path.join(dirpath, name), files.PRIVATE_FILE)
        marker = tmp / MARKER
        files.write_private(marker, meta)
        _fsync(marker)
        step = int(json.loads(meta)["step"])
        # Checkpoints past this step belong to a run that was resumed from an earlier one:
        # they are not this run's future, and `latest()` must not pick them.
        for old in checkpoints(self.root):
            if old.step >= step:
                log.info("removing %s: the run went on from an earlier checkpoint", old.path)
                _remove(old.path)
        os.rename(tmp, final)
        _fsync(self.root)
        self._prune()

    def _prune(self) -> None:
        found = checkpoints(self.root)
        for old in found[: max(0, len(found) - self.keep)]:
            _remove(old.path)

    def _remove_leftovers(self) -> None:
        """Half-written saves of a job that died (nobody reads them)."""
        try:
            entries = list(self.root.iterdir())
        except FileNotFoundError:
            return
        for p in entries:
            if _TMP.match(p.name):
                log.info("removing %s: a save that did not finish", p)
                _remove(p)

    # ------------------------------------------------------------------ load

    def latest(self) -> Checkpoint | None:
        return latest(self.root)

    def load(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        checkpoint: Checkpoint | str | Path | None = None,
    ) -> Checkpoint | None:
        """Restore the model, the optimizer and this rank's RNG states from `checkpoint`
        (default: the latest whole one; rank 0 picks it for every rank). Returns it (its
        `step` and `extra`), or None when there is none (nothing changed)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        self.wait()
        chosen: list[Any] = [None]
        if self.rank == 0:
            if checkpoint is None:
                found = self.latest()
            elif isinstance(checkpoint, Checkpoint):
                found = checkpoint
            else:
                found = _read(Path(checkpoint))
                if found is None:
                    raise UsageError(
                        f"{checkpoint} is not a whole checkpoint (a step-N folder with "
                        f"{MARKER} and DCP's .metadata)"
                    )
            chosen[0] = found
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(chosen, src=0, group=self._pg)
        ckpt: Checkpoint | None = chosen[0]
        if ckpt is None:
            return None
        files.check_dir(ckpt.path)
        state = self._state(model, optimizer)
        key = _RNG_KEY.format(self.rank)
        reader = dcp.FileSystemReader(str(ckpt.path))
        saved = reader.read_metadata().state_dict_metadata.get(key)
        if saved is not None:  # absent: a rank the saving run did not have
            import torch

            state[key] = torch.empty(tuple(saved.size), dtype=torch.uint8)
        dcp.load(state, storage_reader=reader, process_group=self._pg)
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        if key in state:
            _set_rng_state(state[key].numpy().tobytes())
        return ckpt

    def clear(self) -> int:
        """Remove every checkpoint (a run that starts over); returns how many. Collective."""
        self.wait()
        n = 0
        if self.rank == 0:
            for old in checkpoints(self.root):
                _remove(old.path)
                n += 1
        self._barrier()
        return n

    def close(self) -> None:
        """Wait for the save in flight; then this Checkpointer is done (its group freed)."""
        import torch.distributed as dist

        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._pg is not None and dist.is_initialized():
                dist.destroy_process_group(self._pg)
            self._pg = None

    def _barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and self.world_size > 1:
            dist.barrier(group=self._pg)


def _clone(obj: Any) -> Any:
    """A copy of a state dict whose tensors (DTensors too: their local shards) are cloned."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _remove(path: Path) -> None:
    # Renamed aside first, so a reader never sees a checkpoint half removed.
    doomed = path.with_name(f".{path.name}.removing.{os.getpid()}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
