"""A scheduler's run options that name a flag (RunOpt.flag) are flags of `serve` and `train`,
built from the installed schedulers: the built-in ones as they were written by hand before,
an installed plug-in's (tests/plugins/toy_plugin, through its entry point) beside them, and
one flag two schedulers declare unlike is an error when the command is built."""

from __future__ import annotations

import pytest

from areal_cli import plugins, schedulers
from areal_cli._app import _load
from areal_cli.cli import main
from areal_cli.commands import _common
from areal_cli.errors import UsageError
from areal_cli.schedulers.api import RunOpt
from tests.plugins import dist

TOY = {plugins.SCHEDULERS: {"toy": "toy_plugin.scheduler:ToyScheduler"}}
# The flags the built-in schedulers declare, and their YAML kinds (Slurm's, --gpus-per-node
# Ray's too).
BUILT_IN = {
    "partition": "str",
    "account": "str",
    "time": "str",
    "gpus_per_node": "posint",
    "slurm_arg": "list",
}


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Install a distribution (a dist-info on sys.path, as pip leaves one) for this test."""

    def make(name="toy-plugin", entry_points=TOY, modules=None):
        root = dist.make(tmp_path / name, name, entry_points, ("toy_plugin",))
        for module, text in (modules or {}).items():
            (root / f"{module}.py").write_text(text)
        monkeypatch.syspath_prepend(str(root))
        plugins.refresh()

    yield make
    monkeypatch.undo()
    plugins.refresh()


def options(command: str) -> dict:
    return {p.name: p for p in _load(command).params if p.param_type_name == "option"}


@pytest.mark.parametrize("command", ["serve", "train"])
def test_the_built_in_flags_keep_their_help_defaults_and_yaml_kinds(command):
    opts = options(command)
    helps = {
        "partition": "Slurm partition (default: the cluster's).",
        "account": "Slurm account to charge.",
        "time": "Slurm time limit, e.g. 4:00:00.",
        "slurm_arg": "Passed to sbatch as is, e.g. --slurm-arg=--mem=64G. Repeatable.",
    }
    for name, text in helps.items():
        assert opts[name].help == text and opts[name].default is None, name
    assert opts["slurm_arg"].multiple and opts["slurm_arg"].opts == ["--slurm-arg"]
    # One option for the flag Slurm and Ray both declare; its help says what each means.
    gpus = opts["gpus_per_node"]
    assert gpus.opts == ["--gpus-per-node"] and gpus.type.min == 1 and gpus.default is None
    assert "Slurm: GPUs used per node (default: the partition's)" in gpus.help
    assert gpus.help.startswith("Ray: training ranks per node")
    assert {o.name for o in schedulers.flagged_runopts()} == set(BUILT_IN)
    keys = _common.yaml_keys(command)
    assert {k: keys[k] for k in BUILT_IN} == BUILT_IN


def test_a_plugins_flagged_option_is_a_flag_of_serve_and_train(install, monkeypatch, capsys):
    assert "note" not in options("serve")
    install()
    for command in ("serve", "train"):
        note = options(command)["note"]
        assert note.opts == ["--toy-note"]
        assert note.help == "A word the toy keeps in its record."
        assert _common.yaml_keys(command)["note"] == "str"
    # The flag reaches the toy scheduler's options; another scheduler refuses it.
    seen = []
    monkeypatch.setattr(
        "areal_cli.commands.serve.launch", lambda sched, spec, *a, **kw: seen.append(spec)
    )
    serve = ["serve", "--backend", "hf", "--model", "org/tiny", "--dry-run"]
    assert run([*serve, "--scheduler", "toy", "--toy-note", "hello"]) in (0, None)
    assert seen[0].scheduler_opts.note == "hello"
    assert run([*serve, "--toy-note", "hello"]) == 2
    err = capsys.readouterr().err
    assert "--toy-note: not an option of the local scheduler" in err and "--scheduler toy" in err


def run(argv: list[str]):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code


def test_schedulers_that_share_a_flag_share_its_default_where_they_agree():
    def declared(*defaults):
        return [
            (who, (RunOpt("queue", "posint", f"{who}'s slots", "--queue", default=d),))
            for who, d in zip(("A", "B"), defaults, strict=True)
        ]

    (same,) = schedulers.merge_flagged(declared(2, 2))
    assert (same.name, same.kind, same.flag, same.default) == ("queue", "posint", "--queue", 2)
    assert same.help == "A: A's slots; B: B's slots"
    (unlike,) = schedulers.merge_flagged(declared(2, 3))
    assert unlike.default is None  # each scheduler applies its own (jobspec.scheduler_opts)


def _install_declaring(install, name: str, runopt: str) -> None:
    """A scheduler plug-in `name` (the toy's, under that name) that declares `runopt`."""
    src = (
        "from toy_plugin.scheduler import ToyScheduler\n"
        "from areal_cli.schedulers.api import RunOpt\n"
        "class Sched(ToyScheduler):\n"
        f"    name = label = {name!r}\n"
        f"    runopts = ({runopt},)\n"
    )
    install(
        f"{name}-plugin", {plugins.SCHEDULERS: {name: f"{name}_toy:Sched"}}, {f"{name}_toy": src}
    )


def test_one_flag_declared_with_two_kinds_is_an_error_naming_both(install):
    _install_declaring(
        install, "clash", "RunOpt('gpus_per_node', 'str', 'a word', '--gpus-per-node')"
    )
    with pytest.raises(UsageError) as e:
        _load("serve")
    assert e.value.message == (
        "flag --gpus-per-node is clash's option gpus_per_node (str) and Ray's gpus_per_node "
        "(posint)"
    )


def test_a_plugins_flag_that_is_a_commands_own_option_is_an_error(install):
    _install_declaring(install, "own", "RunOpt('model', 'str', 'a model', '--model')")
    with pytest.raises(UsageError) as e:
        _load("serve")
    assert "run option model (--model) is an option of `serve` already" in e.value.message


def test_a_run_option_of_an_unknown_kind_or_flag_is_refused_where_declared():
    with pytest.raises(ValueError, match="kind 'float'"):
        RunOpt("rate", "float", "a rate")
    with pytest.raises(ValueError, match="does not start with --"):
        RunOpt("rate", "str", "a rate", "rate")
