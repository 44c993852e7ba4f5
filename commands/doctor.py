"""`areal doctor`: diagnose distributed training (hangs, env presets, all_reduce, host, mesh).

A group whose sub-commands live in modules of their own (commands/doctor_*.py), each imported
when its command runs or shows its help: `areal doctor --help` lists them from the table below.
"""

from __future__ import annotations

import typer

# name: (module in areal_cli.commands, the one line `areal doctor --help` shows). A test
# checks each line against the first line of the command's own help.
COMMANDS: dict[str, tuple[str, str]] = {
    "hang": ("doctor_hang", "Dump every rank's Python stack at once, group identical stacks, name the odd rank."),
    "env": ("doctor_env", "Debug environment presets: print them for your shell, or run a command under one."),
    "allreduce": ("doctor_allreduce", "Minimal all_reduce repro under torchrun: time, algbw, busbw and a correctness check per size."),
    "check": ("doctor_check", "Is this host ready to run and debug jobs? One row per fact, with the fix."),
    "mesh": ("doctor_mesh", "Every rank's coordinate per mesh dimension and the ranks of each process group."),
    "why": ("doctor_why", "Name the first failure of a job that died and its kind; label what followed from it."),
    "diverge": ("doctor_diverge", "Ask a live job's ranks whether the tensors they should share agree."),
    "memory": ("doctor_memory", "Each rank's memory beside the host's and the cgroup's limits; the biggest rank named."),
    "profile": ("doctor_profile", "Record every rank with py-spy at once; name the rank the others wait for."),
}  # fmt: skip

app = typer.Typer(
    help="""Diagnose distributed training: hangs, debug env presets, all_reduce, host health, mesh.

\b
Examples:
  areal doctor hang --job myexp/trial0   # every rank's stack, odd rank named
  areal doctor why myexp/trial0          # a job that died: its first failure
  areal doctor env --preset nccl -- areal train ...
  areal doctor allreduce --nproc 8       # busbw per size, hang-checked
  areal doctor check                     # is this host ready?
  areal doctor mesh --alloc fsdp:d2t2    # which rank sits where
  areal doctor diverge --job myexp/trial0   # do the replicas agree?
  areal doctor memory --job myexp/trial0    # per rank, beside the limits
  areal doctor profile --job myexp/trial0 -o ./prof   # flame graphs, straggler
""",
    no_args_is_help=True,
)
