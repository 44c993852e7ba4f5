"""Which torch.distributed calls wait for the other ranks: the names the hang doctor looks for
in a stack, taken from torch's own API.

The doctor never imports torch (reading a stack must not cost the seconds torch takes to
import), so the names live in a table generated from torch, `torch_collectives.py`:

    python -m areal_cli.diagnose.collectives && ruff format src/areal_cli/diagnose/torch_collectives.py

`derive()` reads them from the installed torch, and a test checks the table against it, so a
torch release that adds or renames a collective fails that test instead of turning a real hang
into "blocked_outside_collective". Sources, in torch's terms:

- `torch.distributed.distributed_c10d`: every function torch wraps with its c10d logger
  (`c10d_logger._exception_logger`: the collectives, point-to-point calls and group creation),
  and the functions of its `__all__` whose name is a collective (isend, batch_isend_irecv,
  monitored_barrier, new_subgroups, ...);
- `torch.distributed._functional_collectives`: the functional collectives that FSDP2, DTensor
  and compiled code call (all_gather_single, reduce_scatter_tensor, wait_tensor, ...);
- `torch.distributed.device_mesh.__all__`: init_device_mesh, which creates groups;
- the dispatcher's `c10d::` and `_c10d_functional::` ops, seen in native frames.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

from areal_cli.diagnose.torch_collectives import LEGACY, PYTHON

# The collective a name stands for, first match wins: "reduce_scatter" before "scatter" and
# "reduce", "all_gather" before "gather".
_KIND_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), kind)
    for pattern, kind in (
        (r"barrier", "barrier"),
        (r"init_process_group", "init_process_group"),
        (r"new_group|new_subgroups|split_group|shrink_group|init_device_mesh", "new_group"),
        (r"all_?reduce", "all_reduce"),
        (r"all_?gather", "all_gather"),
        (r"reduce_?scatter", "reduce_scatter"),
        (r"all_?to_?all", "all_to_all"),
        (r"broadcast", "broadcast"),
        (r"(^|_)i?(send|recv)(_|$)|p2p", "send/recv"),
        (r"wait_tensor", "work.wait"),
        (r"scatter", "scatter"),
        (r"gather", "gather"),
        (r"(^|_)reduce(_|$)", "reduce"),
    )
)

# Modules whose functions are matched by name, as they appear at the end of a frame's path.
C10D = "torch/distributed/distributed_c10d.py"
FUNCTIONAL = "torch/distributed/_functional_collectives.py"
DEVICE_MESH = "torch/distributed/device_mesh.py"
OP_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def kind_of(name: str) -> str | None:
    """The collective a function or op name runs ("all_gather_single" -> "all_gather")."""
    key = name.lower()
    for pattern, kind in _KIND_RULES:
        if pattern.search(key):
            return kind
    return None


def lookup(path: str, function: str) -> str | None:
    """The collective a Python frame waits in, from its file and (qualified) function name."""
    path = path.replace("\\", "/")
    name = function.rsplit(".", 1)[-1]
    for module, names in PYTHON.items():
        if path.endswith(module):
            return names.get(name) or (LEGACY.get(name) if module == C10D else None)
    return None


# --------------------------------------------------------------------------- from torch


def derive() -> tuple[dict[str, dict[str, str]], dict[str, str], list[str]]:
    """(python names per module, dispatcher ops, logged c10d functions no rule names).

    Imports torch: for the generator and the test, never for the doctor.
    """
    import inspect

    import torch
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.distributed_c10d as c10d

    with warnings.catch_warnings():
        # Touching every attribute of c10d trips its deprecation warnings (reduce_op).
        warnings.simplefilter("ignore")
        return _derive(torch, inspect, c10d, funcol, device_mesh)


def _derive(torch, inspect, c10d, funcol, device_mesh):

    def logged(f: object) -> bool:
        code = getattr(f, "__code__", None)
        return (
            hasattr(f, "__wrapped__")
            and code is not None
            and code.co_filename.replace("\\", "/").endswith("c10d_logger.py")
        )

    c10d_names: dict[str, str] = {}
    unnamed: list[str] = []
    for name, f in vars(c10d).items():
        if logged(f):
            kind = kind_of(name)
            if kind is None:
                unnamed.append(name)
            else:
                c10d_names[name] = kind
    for name in c10d.__all__:
        f = getattr(c10d, name, None)
        if inspect.isfunction(f) and kind_of(name):
            c10d_names.setdefault(name, kind_of(name))

    functional: dict[str, str] = {}
    for name, f in vars(funcol).items():
        if (
            inspect.isfunction(f)
            and f.__module__ == funcol.__name__
            and not name.startswith("_")
            # autograd plumbing: the collective inside shows up as the op, not by this name
            and not name.endswith(("_setup_context", "_backward"))
            and kind_of(name)
        ):
            functional[name] = kind_of(name)

    mesh = {n: kind_of(n) for n in device_mesh.__all__ if kind_of(n)}

    ops: dict[str, str] = {}
    for full in torch._C._dispatch_get_all_op_names():
        namespace, _, op = full.partition("::")
        if namespace in OP_NAMESPACES and kind_of(op):
            ops[full] = kind_of(op)

    python = {
        C10D: dict(sorted(c10d_names.items())),
        FUNCTIONAL: dict(sorted(functional.items())),
        DEVICE_MESH: dict(sorted(mesh.items())),
    }
    return python, dict(sorted(ops.items())), sorted(unnamed)


def render_table() -> str:
    """The text of torch_collectives.py for the installed torch."""
    import pprint

    import torch

    python, ops, unnamed = derive()
    if unnamed:
        raise SystemExit(f"no collective rule names these c10d functions: {unnamed}")
    version = torch.__version__.split("+")[0]
    return (
        f'"""Collectives of torch {version}, generated by `python -m '
        "areal_cli.diagnose.collectives`;\n"
        "do not edit by hand (a test checks this table against the installed torch)."
        '"""\n\n'
        f"TORCH_VERSION = {version!r}\n\n"
        "# Function names per module (matched against the end of a frame's path).\n"
        f"PYTHON: dict[str, dict[str, str]] = {pprint.pformat(python, width=99, sort_dicts=False)}\n\n"
        "# Dispatcher ops, as native frames name them.\n"
        f"OPS: dict[str, str] = {pprint.pformat(ops, width=99, sort_dicts=False)}\n\n"
        "# distributed_c10d functions of older torch releases, kept by hand.\n"
        f"LEGACY: dict[str, str] = {pprint.pformat(LEGACY, width=99, sort_dicts=False)}\n"
    )


if __name__ == "__main__":
    target = Path(__file__).with_name("torch_collectives.py")
    target.write_text(render_table())
    sys.stderr.write(f"wrote {target}\n")
