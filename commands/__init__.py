"""Command groups of the `areal` CLI: thin wrappers that parse flags, call the library, render.

Here too the two tables both parsers read, free of imports (areal_cli.cli reads them on every
call): the commands with their one-line help, and `Opt`, one option's definition, from which
a typer command builds its option and `parse` reads the plain forms that skip typer.
"""

from __future__ import annotations

# name: (module in areal_cli.commands, the one line `areal --help` shows). A test checks
# each line against the first line of the command's own help.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "Start SGLang, vLLM or hf inference servers, wait until healthy, register them."),
    "train": ("train", "Run training workers with torchrun against inference servers."),
    "ps": ("jobs", "List jobs: state, processes, servers and whether each answers /health."),
    "logs": ("jobs", "Show a job's logs, merged with a \\[server-N] / \\[rank-N] prefix."),
    "stop": ("jobs", "Stop a trial's jobs, every process they started and their registry entries."),
    "key": ("key", "Print the API key of servers you started as E/T, for a client of your own."),
    "alloc": ("alloc", "Explain an allocation string: its components, parallel dims and GPU count."),
    "init-model": ("init_model", "Write a tiny Qwen2-style causal LM (random weights, byte-level tokenizer) to DIR."),
    "doctor": ("doctor", "Diagnose distributed training: hangs, debug env presets, all_reduce, host health, mesh."),
}  # fmt: skip

HELP = """Launch and diagnose RL post-training jobs for LLMs.

\b
Examples:
  areal serve --backend hf --model ./tiny --detach
  areal train --alloc fsdp:d2 train.py --config tiny_cpu.yaml
  areal ps
  areal logs E/T -f
  areal stop E/T
  areal doctor hang --job E/T
"""


def first_line(text: str | None) -> str:
    """A help text's first paragraph, on one line."""
    import inspect

    para = inspect.cleandoc(text or "").split("\n\n")[0]
    return " ".join(para.split())


class Opt:
    """One option: its keyword, flags, type, default, bounds and help. A plain class, as
    `dataclasses` imports `inspect` (10 ms of a start-up that skips typer for it)."""

    __slots__ = ("key", "flags", "kind", "default", "lo", "hi", "many", "help")

    def __init__(self, key, *flags, kind=str, default=None, lo=None, hi=None, many=False, help=""):
        self.key, self.flags, self.kind, self.default = key, flags, kind, default
        self.lo, self.hi, self.many, self.help = lo, hi, many, help

    def option(self, **extra):
        """The typer option of this definition (`extra`: typer's own settings, a callback)."""
        import typer

        bounds = {k: v for k, v in (("min", self.lo), ("max", self.hi)) if v is not None}
        default = None if self.many else self.default
        return typer.Option(default, *self.flags, help=self.help, **bounds, **extra)


def parse(table: list[Opt], args: list[str], positional: tuple[str, ...] = ()) -> dict | None:
    """The keywords `args` give `table`'s options (each absent one its default) and the
    `positional` arguments, in order; None for anything but the plain forms (help, an
    unknown flag, a bad or out-of-range value, `-n5`, a missing or extra argument), which
    typer parses and judges with its own messages."""
    flags = {flag: opt for opt in table for flag in opt.flags}
    opts = {opt.key: [] if opt.many else opt.default for opt in table}
    words: list[str] = []
    seen: set[str] = set()
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        opt = flags.get(name)
        i += 1
        if opt is None:
            if args[i - 1].startswith("-") or len(words) == len(positional):
                return None
            words.append(args[i - 1])
            continue
        if opt.key in seen and not opt.many:
            return None  # given twice: typer says which one counts
        seen.add(opt.key)
        if opt.kind is bool:
            if eq:
                return None
            opts[opt.key] = True
            continue
        if eq and not name.startswith("--"):
            return None  # `-p=3`: click reads "=3" as the value
        if not eq:
            if i >= len(args) or args[i].startswith("-"):
                return None
            value, i = args[i], i + 1
        parsed = _value(opt, value)
        if parsed is None:
            return None
        if opt.many:
            opts[opt.key].append(parsed)
        else:
            opts[opt.key] = parsed
    if len(words) != len(positional):
        return None
    return {**opts, **dict(zip(positional, words, strict=True))}


def _value(opt: Opt, value: str):
    """`value` as `opt` takes it, or None where typer's message is due."""
    if not value.strip():  # an empty path: typer's message
        return None
    try:
        parsed = opt.kind(value)
    except ValueError:
        return None
    if opt.kind is float and parsed - parsed != 0:
        return None  # nan or inf (x - x is nan for both)
    if (opt.lo is not None and parsed < opt.lo) or (opt.hi is not None and parsed > opt.hi):
        return None
    return parsed
