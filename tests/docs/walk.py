"""Running the manual's blocks as a reader would (the conventions are in manual.py and
docs/tests.md); the tests are test_manual*.py, one test per block, id PAGE:LINE.

A page is a walk: its blocks run in order in one sandbox of their own, a fresh directory
under /tmp as short as a checkout's path, holding links to the checkout's templates/,
scripts/, tests/ and .venv/ and the tiny model at ./demo-model where the page uses it without
making it; AREAL_HOME, the registry and HOME are the page's own (in its .walk/), the venv's
bin first on PATH. Variables a command exports and the directory it changes to carry to the
page's next command. After the page's last block, `PAGE:end` stops what the page left
running (`areal stop --all`) and fails if anything the page started is still alive.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.docs.manual import (
    REPO,
    SHELL,
    Block,
    console_steps,
    mismatch,
    pages,
    problem,
    read_blocks,
)
from tests.helpers import live_with_home

VENV_BIN = Path(sys.executable).parent
AREAL = str(VENV_BIN / "areal")
COMMAND_TIMEOUT = 180  # seconds for one command of the manual
# The width the manual's printouts were taken at: a wide terminal, where tables keep a row
# to a line (a pipe's 80 columns wrap them; that layout has tests of its own).
COLUMNS = "200"
# Where README.md and docs/ are read from: the checkout, or a draft of the manual elsewhere.
DOCS = Path(os.environ.get("AREAL_DOCS_ROOT", REPO))
# What a checkout holds that the manual's commands name by relative path (recorded logs in
# tests/fixtures, `source .venv/bin/activate`).
CHECKOUT_LINKS = ("templates", "scripts", "tests", ".venv")


# Pages with a test module of their own (test_manual_NAME.py), so that parallel test workers
# (`make test`, one module per worker) walk them beside the others: each takes minutes.
OWN_MODULE = ("docs/doctor.md", "docs/train.md")


def items(only: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> list:
    """pytest params, in page order: each block of the pages, then the page's `end`."""
    params = []
    for page in pages(DOCS):
        rel = str(page.relative_to(DOCS))
        if (only and rel not in only) or rel in skip:
            continue
        blocks = read_blocks(page, DOCS)
        for block in blocks:
            params.append(pytest.param(block, id=block.id))
        if blocks:
            params.append(pytest.param(rel, id=f"{rel}:end"))
    return params


def _wants_model(page: str) -> bool:
    """Whether the page's commands use ./demo-model without making it themselves (`areal
    init-model demo-model`)."""
    run = [b.text for b in read_blocks(DOCS / page, DOCS)
           if b.lang in SHELL and "not run" not in b.markers]  # fmt: skip
    made = {m for text in run for m in re.findall(r"areal init-model\s+([^\s;|&]+)", text)}
    return "demo-model" not in made and any(
        re.search(r"(?<![\w/.-])demo-model\b", text) for text in run
    )


class Walk:
    """One page's sandbox and shell state."""

    def __init__(self, page: str, model: Path | None):
        # The reader's directory: short, as a checkout's is (`areal ps` folds a model path
        # longer than its job column), the harness's own files hidden in .walk/.
        self.page = page
        self.cwd = Path(tempfile.mkdtemp(prefix="", dir="/tmp"))
        self.root = self.cwd / ".walk"
        self.home = self.root / "home"
        for d in (self.home, self.root / "user", self.root / "blocks"):
            d.mkdir(parents=True)
        for name in CHECKOUT_LINKS:
            (self.cwd / name).symlink_to(REPO / name)
        if model is not None:
            shutil.copytree(model, self.cwd / "demo-model")
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": str(self.root / "user"),
            "AREAL_HOME": str(self.home),
            "AREAL_REGISTRY": str(self.root / "registry"),
            "COLUMNS": COLUMNS,
            "NO_COLOR": "1",
            "TERM": "dumb",
        }
        self.env.pop("VIRTUAL_ENV", None)
        self.state, self.where = self.root / "state.sh", self.root / "cwd"
        self.where.write_text(str(self.cwd))
        self.services: set[str] = set()

    def export(self, values: dict[str, str]) -> None:
        """Set variables for the page's next commands, over what earlier ones exported."""
        self.env.update(values)
        with self.state.open("a") as f:
            f.writelines(f"export {k}={shlex.quote(v)}\n" for k, v in values.items())

    def shell(self, command: str, strict: bool = False) -> tuple[int, str]:
        """Run `command` in the page's shell state; its exit code and output (stdout and
        stderr as a terminal shows them, interleaved)."""
        script = self.root / "command.sh"
        script.write_text(command + "\n")
        wrapper = (
            f'[ -f {self.state} ] && . {self.state}; cd "$(cat {self.where})" || exit 99; '
            f"{'set -eo pipefail; ' if strict else ''}. {script}; rc=$?; "
            f"export -p > {self.state}; pwd > {self.where}; exit $rc"
        )
        out = self.root / "output"
        with out.open("wb") as f:
            # A file, not a pipe: a detached server keeps no descriptor of ours open, but a
            # pipe's reader would wait for every holder of its write end.
            proc = subprocess.Popen(
                ["bash", "-c", wrapper], stdin=subprocess.DEVNULL, stdout=f,
                stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
            )  # fmt: skip
            try:
                rc = proc.wait(timeout=COMMAND_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                text = out.read_text(errors="replace")
                pytest.fail(f"`{command}` ran past {COMMAND_TIMEOUT}s\n{text[-3000:]}")
        return rc, out.read_text(errors="replace")

    def ours(self) -> list[psutil.Process]:
        """Live processes started by this page: every one carries its AREAL_HOME."""
        return live_with_home(self.home)

    def close(self) -> list[str]:
        """Stop what the page started; describe whatever survived (and kill it)."""
        subprocess.run(
            [AREAL, "stop", "--all"], env=self.env, cwd=self.cwd, capture_output=True,
            timeout=120,
        )  # fmt: skip
        # `areal stop` returns once what it stopped is gone; a few seconds more for processes
        # that were exiting by themselves (as the suite's own leak check allows).
        deadline = time.monotonic() + 5
        left = self.ours()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.ours()
        desc = []
        for p in left:
            try:
                desc.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
                p.kill()
            except psutil.Error:
                continue
        psutil.wait_procs(left, timeout=5)
        shutil.rmtree(self.cwd, ignore_errors=True)
        return desc


def run_block(block: Block | str, walks: dict[str, Walk], request) -> None:
    """One block of a page's walk, or (a str, the page) the page's end."""
    if isinstance(block, str):  # the page's end
        walk = walks.pop(block, None)
        if walk is not None and (left := walk.close()):
            pytest.fail(f"{block} left processes behind:\n" + "\n".join(left))
        return
    why = problem(block)
    if why:
        pytest.fail(f"{block.id}: {why}", pytrace=False)
    if "not run" in block.markers or block.lang == "text" and "file" not in block.markers:
        pytest.skip(f"not run: {block.markers.get('not run') or 'text'}")
    walk = walks.get(block.page)
    if walk is None:
        model = request.getfixturevalue("tiny_model") if _wants_model(block.page) else None
        walk = walks[block.page] = Walk(block.page, model)
    _needs(block, walk, request)
    if "file" in block.markers:
        # Relative to where the page's shell is now (a `cd` in an earlier block counts).
        target = Path(walk.where.read_text().strip()) / block.markers["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text)
        _check_file(block, target, walk)
    elif block.lang == "console":
        _run_console(block, walk)
    elif block.lang in SHELL:
        rc, out = walk.shell(block.text, strict=True)
        assert rc == 0, f"{block.id}: exit {rc}\n{out[-3000:]}"
    elif block.lang == "python" and "fragment" not in block.markers:
        path = walk.root / "blocks" / f"block_{block.line}.py"
        path.write_text(block.text)
        rc, out = walk.shell(f"python {path}")
        assert rc == 0, f"{block.id}: the program exited {rc}\n{out[-3000:]}"
    else:
        path = walk.root / "blocks" / f"block_{block.line}.{block.lang}"
        path.write_text(block.text)
        _check_file(block, path, walk)


def _run_console(block: Block, walk: Walk) -> None:
    """Every command of the session, then its differences: a later command (the `areal
    stop` that ends an example) still runs, and the page's next blocks find what it left."""
    wrong = []
    for step in console_steps(block.text):
        rc, out = walk.shell(step.command)
        if not any(line.strip() for line in step.expected):
            if rc != 0:
                wrong.append(f"`{step.command}` exited {rc}\n{out[-3000:]}")
            continue
        diff = mismatch(step.expected, out)
        if diff is not None:
            wrong.append(f"`{step.command}` (exit {rc}):\n{diff}")
    assert not wrong, f"{block.id}: " + "\n\n".join(wrong)


def _check_file(block: Block, path: Path, walk: Walk) -> None:
    """Parse a file's contents as its language says; a job YAML goes through a dry run."""
    text = path.read_text()
    if block.lang == "python":
        compile(text, str(path), "exec")
    elif block.lang in ("yaml", "yml"):
        data = yaml.safe_load(text)
        command = _job_command(data)
        if command:
            rc, out = walk.shell(f"areal {command} --config {path} --dry-run")
            assert rc == 0, f"{block.id}: areal {command} --dry-run exited {rc}\n{out[-3000:]}"
    elif block.lang == "json":
        json.loads(text)


def _job_command(data) -> str | None:
    """serve or train when `data` is a job config of one of them (its keys are that command's
    config keys), else None."""
    from areal_cli.commands._common import yaml_keys

    if not isinstance(data, dict) or not data:
        return None
    keys = set(data)
    fits = [name for name in ("serve", "train") if keys <= set(yaml_keys(name))]
    if len(fits) == 2:  # only shared keys: an inference allocation is a server's
        alloc = str(data.get("alloc", ""))
        return "serve" if re.match(r"\s*(sglang|vllm|hf)\b", alloc) else "train"
    return fits[0] if fits else None


def _needs(block: Block, walk: Walk, request) -> None:
    """Bring up the service a block's `needs` marker names and put its environment into the
    page's (once per page)."""
    name = block.markers.get("needs")
    if not name or name in walk.services:
        return
    from services import SERVICES

    if name not in SERVICES:
        pytest.fail(f"{block.id}: unknown service {name!r} (one of {', '.join(SERVICES)})")
    _, missing, require = SERVICES[name]
    reason = missing()
    if reason:
        if os.environ.get(require) == "1":
            pytest.fail(f"{reason}, and {require}=1", pytrace=False)
        pytest.skip(reason)
    if name == "etcd":
        server = request.getfixturevalue("etcd_server")
        walk.export({"AREAL_REGISTRY": server.url})
    else:
        cluster = request.getfixturevalue(f"{name}_cluster")
        walk.export(cluster.env)
    walk.services.add(name)
