"""The plug-in registry (plugins.py): what its own reading of the entry points finds is what
importlib.metadata finds; aliases, a name two distributions declare, a distribution only
importlib.metadata can read (a zip), and the one error that lists the valid names."""

from __future__ import annotations

import warnings
import zipfile
from importlib import metadata

import pytest

from areal_cli import plugins
from areal_cli.errors import ArealWarning, UsageError
from tests.plugins import dist


@pytest.fixture
def path(monkeypatch):
    """Put folders first on sys.path, as PYTHONPATH would; the registry reads them afresh."""

    def prepend(folder):
        monkeypatch.syspath_prepend(str(folder))
        plugins.refresh()
        return folder

    yield prepend
    monkeypatch.undo()
    plugins.refresh()


@pytest.mark.parametrize("group", [plugins.ENGINES, plugins.SCHEDULERS, plugins.REGISTRIES])
def test_its_reading_is_importlib_metadatas(group, tmp_path, path):
    path(dist.make(tmp_path, "extra", {group: {"x1": "os:sep", "x2": "os:sep"}}))
    ours = {n: plugins.target(group, n) for n in plugins.names(group)}
    ours.update(
        {a: plugins.target(group, a) for n in ours.copy() for a in plugins.aliases(group, n)}
    )
    theirs = {ep.name: ep.value for ep in metadata.entry_points(group=group)}
    assert ours == theirs and "x1" in ours


def test_aliases_name_one_plugin_and_load_the_same_object(tmp_path, path):
    group = {plugins.SCHEDULERS: {"k8s": "os.path:join", "kube": "os.path:join"}}
    path(dist.make(tmp_path, "kube-sched", group))
    import os.path

    assert plugins.aliases(plugins.SCHEDULERS, "kube") == ["kube", "k8s"]
    assert plugins.load(plugins.SCHEDULERS, "k8s") is plugins.load(plugins.SCHEDULERS, "kube")
    assert plugins.load(plugins.SCHEDULERS, "kube") is os.path.join
    assert [n for n in plugins.names(plugins.SCHEDULERS) if n in ("k8s", "kube")] == ["k8s"]


def test_an_unknown_name_is_one_usage_error_listing_every_name(tmp_path, path):
    path(dist.make(tmp_path, "kube-sched", {plugins.SCHEDULERS: {"k8s": "a:B", "kube": "a:B"}}))
    with pytest.raises(UsageError) as e:
        plugins.load(plugins.SCHEDULERS, "nope")
    assert e.value.message == "unknown scheduler 'nope'" and e.value.exit_code == 2
    assert "k8s or kube" in e.value.hint and "local" in e.value.hint and "slurm" in e.value.hint


def test_the_first_distribution_on_sys_path_wins_and_says_whom_it_replaces(tmp_path, path):
    path(dist.make(tmp_path / "b", "site-b", {plugins.SCHEDULERS: {"mine": "os:getcwd"}}))
    path(dist.make(tmp_path / "a", "site-a", {plugins.SCHEDULERS: {"mine": "os:getpid"}}))
    import os

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plugins.load(plugins.SCHEDULERS, "mine") is os.getpid
    (w,) = caught
    assert w.category is ArealWarning
    assert (
        str(w.message) == "scheduler 'mine': site_a-0.1's os:getpid replaces site_b-0.1's os:getcwd"
    )


def test_one_distribution_twice_on_sys_path_counts_once(tmp_path, path):
    # As importlib.metadata does: the first copy of a distribution hides later ones.
    path(dist.make(tmp_path / "old", "same", {plugins.SCHEDULERS: {"mine": "os:getcwd"}}))
    path(dist.make(tmp_path / "new", "same", {plugins.SCHEDULERS: {"mine": "os:getpid"}}))
    import os

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plugins.load(plugins.SCHEDULERS, "mine") is os.getpid


def test_a_distribution_only_importlib_metadata_reads_is_found_on_a_miss(tmp_path, path):
    # A zipped distribution: the fast reading lists folders only; the name it does not find
    # is looked up through importlib.metadata before it is called unknown.
    made = dist.make(tmp_path / "src", "zipped", {plugins.REGISTRIES: {"zz": "os:getcwd"}})
    archive = tmp_path / "zipped.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in made.rglob("*"):
            z.write(f, f.relative_to(made).as_posix())
    path(archive)
    import os

    assert "zz" not in plugins.names(plugins.REGISTRIES)
    assert plugins.load(plugins.REGISTRIES, "zz") is os.getcwd


@pytest.mark.parametrize(
    ("value", "said"),
    [("no_such_module_here:X", "ModuleNotFoundError"), ("os:no_such_attr", "AttributeError")],
)
def test_an_entry_that_does_not_load_is_one_usage_error_naming_it(value, said, tmp_path, path):
    path(dist.make(tmp_path, "bad", {plugins.ENGINES: {"bad": value}}))
    with pytest.raises(UsageError) as e:
        plugins.load(plugins.ENGINES, "bad")
    assert e.value.message.startswith(f"backend 'bad' (entry point bad = {value} of bad-0.1)")
    assert said in e.value.message


def test_a_base_class_is_checked(tmp_path, path):
    from areal_cli.schedulers.api import Scheduler

    path(dist.make(tmp_path, "bad", {plugins.SCHEDULERS: {"bad": "json:JSONDecoder"}}))
    with pytest.raises(UsageError, match="json:JSONDecoder is not a scheduler class"):
        plugins.load(plugins.SCHEDULERS, "bad", base=Scheduler)


def test_ps_asks_the_schedulers_a_home_noted_and_a_home_from_before_the_index_is_seeded(
    tmp_path, path
):
    from areal_cli import schedulers
    from tests.integration.test_scheduler_plugin import TOY

    path(dist.make(tmp_path / "site", "toy-plugin", TOY, ("toy_plugin",)))
    home = tmp_path / "home"
    (home / "toy").mkdir(parents=True)  # the toy's records, from before the index
    assert [s.name for s in schedulers.used(home)] == ["toy"]  # each scheduler asked
    schedulers.note_used(home, "local")
    assert sorted(p.name for p in (home / schedulers.USED).iterdir()) == ["local", "toy"]
    assert sorted(s.name for s in schedulers.used(home)) == ["local", "toy"]
    (home / schedulers.USED / "gone").touch()  # a plug-in uninstalled since
    assert sorted(s.name for s in schedulers.used(home)) == ["local", "toy"]


def test_areal_declares_its_own_plugins_in_its_metadata():
    def declared(group):
        return {n: plugins.target(group, n) for n in plugins.names(group)}

    assert declared(plugins.SCHEDULERS) == {
        "local": "areal_cli.schedulers.local:LocalScheduler",
        "ray": "areal_cli.schedulers.ray:RayScheduler",
        "slurm": "areal_cli.schedulers.slurm:SlurmScheduler",
    }
    assert declared(plugins.REGISTRIES) == {
        "etcd": "areal_cli.registry.etcd:EtcdRegistry",
        "file": "areal_cli.registry.file:FileRegistry",
    }
    assert set(declared(plugins.ENGINES)) == {"hf", "sglang", "vllm"}


@pytest.mark.parametrize(
    ("given", "scheme", "url"),
    [
        ("/tmp/reg", "file", "/tmp/reg"),
        ("file:///tmp/reg", "file", "/tmp/reg"),
        ("/tmp/a://b", "file", "/tmp/a:/b"),  # a path, however odd, is a path
        ("etcd://127.0.0.1:2379", "etcd", "etcd://127.0.0.1:2379"),
        ("toy:///x", "toy", "toy:///x"),  # a plug-in's URL, as given
    ],
)
def test_a_registry_url_names_its_plugin_by_its_scheme(given, scheme, url):
    from areal_cli import settings

    assert settings.registry_scheme(given) == scheme
    assert settings.registry_url(given) == url


def test_a_registry_declares_its_features():
    from areal_cli.registry import registry_class

    assert registry_class("/tmp/reg").shared_filesystem is True
    assert registry_class("etcd://h:1").shared_filesystem is False
    assert registry_class("etcd://h:1").leftovers_expire
    with pytest.raises(UsageError, match="unknown registry scheme 'nope'") as e:
        registry_class("nope://x")
    assert "etcd, file" in e.value.hint or "file, etcd" in e.value.hint
