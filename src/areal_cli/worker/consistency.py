"""Do the ranks that should hold the same tensors hold them? `check_consistency` is a
collective: every rank calls it at the same point and gets the same report.

What must agree is read from each tensor: a DTensor must be equal along every mesh dimension
where its placement is `Replicate` (its local shard is compared among those ranks); a plain
tensor (a model that is not sharded, a buffer, an optimizer's step) across the data-parallel
group (the runtime's `dp` mesh dimension, else the whole world). The loss, when given, is the
one every rank should report (reduced across ranks, as it is logged) and is compared across
the whole world.

Checksums travel, not tensors: per tensor its sum, its sum of squares and a wrapped sum of its
bytes as 64-bit words (one all_gather of float64 triples per group of ranks). A tensor whose checksums differ is then
confirmed on the tensor itself (all_gathered within its group): the largest absolute
difference from the reference rank (the majority's value; on a tie, the value of the group's
lowest rank). At most `confirm` tensors are confirmed; the rest are reported unconfirmed.

A live job's ranks run it on the doctor's request (`areal doctor diverge`), in two phases
so that no rank can enter the check's collectives alone: the doctor arms a step on every rank
(a rank accepts only while it has not reached that step), then commits it on all or cancels
it on all. A rank that reaches an armed step before the doctor's decision waits for it there
(at most PENDING_WAIT_S); `ctx.progress(step)` then runs the check from the main thread, so
every rank enters the collectives at the same step, or none does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from areal_cli.worker import channel, context


@dataclass
class Mismatch:
    name: str
    kind: str  # param | buffer | grad | optim | loss
    dim: str  # the mesh dimension (or "dp", "world") along which it must agree
    group: list[int]  # the global ranks of that group
    ranks: list[int]  # the ranks whose value differs from the reference
    reference_rank: int
    max_abs_diff: float | None  # None: not confirmed on the tensor (past `confirm`)
    shape: list[int] = field(default_factory=list)


@dataclass
class Report:
    ok: bool
    checked: int  # tensors compared with at least one other rank
    skipped: int  # sharded along every dimension: nothing to compare
    mismatches: list[Mismatch]
    seconds: float
    world_size: int
    step: int | None = None

    def to_json(self) -> dict:
        return asdict(self)


def check_consistency(
    model: Any,
    optimizer: Any = None,
    loss: Any = None,
    *,
    group: Any = None,
    confirm: int = 16,
    step: int | None = None,
) -> Report:
    """Compare parameters, buffers, gradients (when present), optimizer state and the loss
    across the ranks that should agree. Collective: call it on every rank at the same point.
    `group`: where plain tensors must agree (default: the runtime's dp group, else the world)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    if not dist.is_initialized():
        return Report(True, 0, 0, [], time.perf_counter() - t0, 1, step)
    items = _items(model, optimizer, loss)
    buckets, skipped = _by_group(items, _plain_group(group))
    found, checked = _compare(buckets, confirm)
    mismatches, checked_all, skipped_all = _everyones(found, checked, skipped)
    order = {n: i for i, (n, _k, _t) in enumerate(items)}
    mismatches.sort(key=lambda m: (order.get(m.name, 0), m.group))
    return Report(
        ok=not mismatches,
        checked=checked_all,
        skipped=skipped_all,
        mismatches=mismatches,
        seconds=round(time.perf_counter() - t0, 4),
        world_size=dist.get_world_size(),
        step=step,
    )


def _by_group(items: list[tuple[str, str, Any]], plain: Any) -> tuple[dict[tuple, dict], int]:
    """The tensors by the group they are compared in, and how many are compared nowhere.
    Keys and order are the same on every rank (the model's structure is), so the
    collectives line up."""
    buckets: dict[tuple, dict] = {}
    skipped = 0
    for name, kind, t in items:
        for key, pg, local in _placements(t, plain, kind):
            if key is None:
                skipped += 1
                continue
            b = buckets.setdefault(key, {"pg": pg, "items": []})
            b["items"].append((name, kind, local))
    return buckets, skipped


def _compare(buckets: dict[tuple, dict], confirm: int) -> tuple[list[Mismatch], int]:
    """One all_gather of checksums per group; the differing tensors, the first `confirm` of
    them confirmed on the tensor itself. Also how many tensors were compared."""
    import torch
    import torch.distributed as dist

    found: list[Mismatch] = []
    checked = 0
    budget = confirm
    for key, b in buckets.items():
        pg = b["pg"]
        ranks = dist.get_process_group_ranks(pg)
        if len(ranks) < 2:
            continue
        checked += len(b["items"])
        sums = torch.stack([_checksum(local) for _, _, local in b["items"]])
        dev = _device(pg)
        sums = sums.to(dev)
        gathered = [torch.empty_like(sums) for _ in ranks]
        dist.all_gather(gathered, sums, group=pg)
        # Bit-exact comparison: a NaN equals itself here.
        rows = torch.stack(gathered).cpu().view(torch.int64)
        for i, (name, kind, local) in enumerate(b["items"]):
            values = [tuple(rows[r, i].tolist()) for r in range(len(ranks))]
            if len(set(values)) == 1:
                continue
            ref = _reference(values)
            differ = [ranks[r] for r, v in enumerate(values) if v != values[ref]]
            diff = None
            if budget > 0:
                budget -= 1
                diff = _confirm(local, pg, ranks, ref, dev)
            found.append(
                Mismatch(
                    name, kind, key[0], list(ranks), differ, ranks[ref], diff, list(local.shape)
                )  # fmt: skip
            )
    return found, checked


def _everyones(
    found: list[Mismatch], checked: int, skipped: int
) -> tuple[list[Mismatch], int, int]:
    """Every rank gets the whole report: groups it is not part of included."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ([asdict(m) for m in found], checked, skipped))
    merged: dict[tuple, dict] = {}
    for mism, _c, _s in everyone:
        for m in mism:
            merged.setdefault((m["name"], tuple(m["group"])), m)
    # Per tensor, not per rank: what the rank that compared most saw.
    checked_all = max(c for _m, c, _s in everyone)
    skipped_all = max(s for _m, _c, s in everyone)
    return [Mismatch(**m) for m in merged.values()], checked_all, skipped_all


def _items(model, optimizer, loss) -> list[tuple[str, str, Any]]:
    import torch

    out: list[tuple[str, str, Any]] = []
    names = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        out.append((name, "param", p.detach()))
    for name, p in model.named_parameters():
        if p.grad is not None:
            out.append((f"{name}.grad", "grad", p.grad.detach()))
    for name, buf in model.named_buffers():
        out.append((name, "buffer", buf.detach()))
    if optimizer is not None:
        for gi, g in enumerate(optimizer.param_groups):
            for pi, p in enumerate(g["params"]):
                state = optimizer.state.get(p) or {}
                pname = names.get(id(p), f"group{gi}.param{pi}")
                for k in sorted(state):
                    v = state[k]
                    if isinstance(v, torch.Tensor):
                        out.append((f"optim.{pname}.{k}", "optim", v.detach()))
    if loss is not None:
        t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        out.append(("loss", "loss", t))
    return out


def _plain_group(group):
    import torch.distributed as dist

    if group is not None:
        return ("group", group)
    ctx = context.CURRENT
    if ctx is not None and "dp" in (ctx.mesh.mesh_dim_names or ()):
        return ("dp", ctx.mesh["dp"].get_group())
    return ("world", dist.group.WORLD)


def _placements(t, plain, kind):
    """(key, group, local tensor) for each group of ranks `t` must agree in; (None, ...) when
    it is sharded along every dimension."""
    from torch.distributed.tensor import DTensor, Replicate

    if kind == "loss":
        import torch.distributed as dist

        return [(("world", "loss"), dist.group.WORLD, t)]
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        local = t.to_local()
        out = []
        for i, placement in enumerate(t.placements):
            if isinstance(placement, Replicate) and mesh.size(i) > 1:
                out.append(((names[i], tuple(names), tuple(mesh.mesh.shape)),
                            mesh.get_group(i), local))  # fmt: skip
        return out or [(None, None, None)]
    return [((plain[0], "plain"), plain[1], t)]


def _checksum(t):
    """[sum, sum of squares, wrapped sum of the bytes as 64-bit words] as float64 (the last
    bit-cast): one pass each in the tensor's own dtype, no float64 copy (that costs 12x)."""
    import torch

    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(3, dtype=torch.float64)
    if flat.is_floating_point():
        s = flat.sum(dtype=torch.float32 if flat.element_size() < 4 else None)
        sq = torch.dot(flat, flat) if flat.element_size() >= 4 else (flat.float() ** 2).sum()
    else:
        x = flat.to(torch.float64)  # integer and bool buffers are small
        s, sq = x.sum(), torch.dot(x, x)
    return torch.stack(
        [s.to(torch.float64), sq.to(torch.float64), _bits(flat).view(torch.float64)]
    ).cpu()


def _bits(flat):
    """The bytes as int64 words (the tail as smaller words), summed with wrap-around: any
    changed bit changes it."""
    import torch

    raw = flat.contiguous().view(torch.uint8)
    n = raw.numel() // 8 * 8
    try:
        words = raw[:n].view(torch.int64)
    except RuntimeError:  # a view at an offset that is no multiple of 8 bytes
        words = raw[:n].clone().view(torch.int64)
    total = words.sum() if n else torch.zeros((), dtype=torch.int64)
    if n < raw.numel():
        total = total + raw[n:].to(torch.int64).sum()
    return total.reshape(())


def _reference(values: list[tuple]) -> int:
    counts: dict[tuple, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    best = max(counts.values())
    # The majority's value; on a tie, the lowest rank's (the one checkpoints come from).
    return next(i for i, v in enumerate(values) if counts[v] == best)


def _confirm(local, pg, ranks, ref: int, dev) -> float:
    import torch
    import torch.distributed as dist

    t = local.detach().contiguous().to(dev)
    got = [torch.empty_like(t) for _ in ranks]
    dist.all_gather(got, t, group=pg)
    refv = got[ref].to(torch.float64)
    worst = 0.0
    for g in got:
        d = (g.to(torch.float64) - refv).abs()
        if d.numel():
            # NaN on one side counts as infinitely far.
            d = torch.nan_to_num(d, nan=float("inf"))
            worst = max(worst, float(d.max()))
    return worst


def _device(pg):
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(pg)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------- on request

# How long a rank that reached an armed step waits for the doctor's commit or cancel. The
# doctor decides within a round trip to each node; past this it has gone (killed between its
# two phases), and the rank goes on without the check rather than stall training for ever.
PENDING_WAIT_S = 30.0

_LOCK = threading.Lock()
# step -> {"state": "pending" | "committed", "decided": Event, "event": Event (the report is
# in), "report": dict | None}
_ARMED: dict[int, dict] = {}
_TARGETS: dict[str, Any] = {}  # what the runtime checks: model, optimizer (from watch())


def watch(model: Any, optimizer: Any = None) -> None:
    """Name the model (and optimizer) `areal doctor diverge` should check in this rank."""
    _TARGETS["model"] = model
    _TARGETS["optimizer"] = optimizer


def armed() -> bool:
    return bool(_ARMED)


def at_step(step: int) -> None:
    """Called by ctx.progress(step) on the main thread: run a check armed for this step."""
    with _LOCK:
        slot = _ARMED.get(step)
    if slot is None or slot.get("report") is not None:
        return
    if slot["state"] == "pending":
        # The doctor has not decided yet: running now could put this rank alone in the
        # check's collectives, going on could leave the others there alone.
        slot["decided"].wait(PENDING_WAIT_S)
        with _LOCK:
            if slot["state"] != "committed":
                if _ARMED.get(step) is slot:
                    del _ARMED[step]
                slot["state"] = "expired"
                return
    model = _TARGETS.get("model")
    if model is None:
        import torch.distributed as dist

        # Still a collective: the other ranks may have a model, this one must keep pace.
        rep = {"ok": False, "error": "no model to check: call areal_cli.worker.watch(model)"}
        if dist.is_initialized():
            errs: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(errs, rep["error"])
    else:
        try:
            rep = check_consistency(model, _TARGETS.get("optimizer"), step=step).to_json()
        except Exception as e:  # the job goes on; the doctor hears why
            rep = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    slot["report"] = rep
    slot["event"].set()


def _arm(req: dict) -> dict:
    """Phase one: accept `step` while this rank has not reached it (`commit: true` arms it
    at once, for a single rank)."""
    step = int(req["step"])
    rank = channel._env_int("RANK")
    with _LOCK:
        # Read under the lock: the main thread records a step before it looks for a slot,
        # so a step seen below it here is one whose at_step has not looked yet.
        now = channel.PROGRESS.step
        if now is not None and now >= step:
            return {"armed": False, "current": now, "rank": rank}
        slot = _ARMED.setdefault(step, {"state": "pending", "decided": threading.Event(),
                                        "event": threading.Event(), "report": None})  # fmt: skip
        if req.get("commit"):
            slot["state"] = "committed"
            slot["decided"].set()
    return {"armed": True, "current": now, "rank": rank, "has_model": "model" in _TARGETS}


def _commit(req: dict) -> dict:
    """Phase two: every rank accepted; run the check when the step comes."""
    with _LOCK:
        slot = _ARMED.get(int(req["step"]))
        if slot is None or slot["state"] not in ("pending", "committed"):
            return {"committed": False, "current": channel.PROGRESS.step}
        slot["state"] = "committed"
        slot["decided"].set()
    return {"committed": True, "current": channel.PROGRESS.step}


def _cancel(req: dict) -> dict:
    """Phase two: some rank was past the step; withdraw it (only while nothing ran)."""
    with _LOCK:
        slot = _ARMED.get(int(req["step"]))
        if slot is not None and slot["report"] is None and slot["state"] == "pending":
            del _ARMED[int(req["step"])]
            slot["state"] = "cancelled"
            slot["decided"].set()
            return {"cancelled": True}
    return {"cancelled": False}


def _result(req: dict) -> dict:
    step = int(req["step"])
    slot = _ARMED.get(step)
    if slot is None:
        return {"done": False, "error": f"no check armed for step {step}"}
    slot["event"].wait(float(req.get("wait", 0)))
    if slot["report"] is None:
        return {"done": False, "current": channel.PROGRESS.step}
    with _LOCK:
        _ARMED.pop(step, None)
    return {"done": True, "report": slot["report"]}


channel.register("diverge_arm", _arm)
channel.register("diverge_commit", _commit)
channel.register("diverge_cancel", _cancel)
channel.register("diverge_result", _result)
