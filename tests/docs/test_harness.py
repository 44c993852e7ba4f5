"""The manual's harness itself: what it reads as a block, what it calls the same shape, and a
walk over a page of its own, run through pytest as `make test` runs the manual."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.docs.manual import console_steps, mismatch, problem, read_blocks

PAGE = """\
# a page

<!-- not run: needs a GPU -->
```bash
areal serve --backend sglang --model /models/m
```

- in a list:

  <!-- fragment -->
  ```python
  client.generate(ids)
  ```

## indented

    indented code

<!-- not run: -->
```console
$ true
```

```toml
a = 1
```
"""


def test_blocks_markers_and_problems(tmp_path):
    page = tmp_path / "README.md"
    page.write_text(PAGE)
    blocks = read_blocks(page, tmp_path)
    assert [(b.id, b.lang) for b in blocks] == [
        ("README.md:4", "bash"),
        ("README.md:11", "python"),
        ("README.md:17", ""),
        ("README.md:20", "console"),
        ("README.md:24", "toml"),
    ]
    gpu, fragment, indented, no_reason, toml = blocks
    assert gpu.markers == {"not run": "needs a GPU"} and problem(gpu) is None
    assert fragment.markers == {"fragment": ""} and fragment.text == "client.generate(ids)\n"
    assert problem(fragment) is None
    assert "without a language" in problem(indented)
    assert "needs a reason" in problem(no_reason)
    assert "cannot run 'toml'" in problem(toml)


def test_console_steps_split_commands_and_output():
    steps = console_steps("$ a \\\n  --b\nout 1\n\n$ c\nout 2\n")
    assert [(s.command, s.expected) for s in steps] == [
        ("a \\\n  --b", ["out 1", ""]),
        ("c", ["out 2"]),
    ]
    assert console_steps("output first\n$ a\n") == []


PS = """\
job             kind   state    where            servers            GPUs
default/trial0  serve  running  pids 1975 1978   ● 127.0.0.1:30000  cpu
"""


def test_shape_ignores_numbers_paths_and_spacing_but_not_columns():
    real = (
        "job   kind  state  where  servers  GPUs\n"
        "default/trial0 serve running pids 31 32 ● 127.0.0.1:41000 cpu\n"
    )
    assert mismatch(PS.splitlines(), real) is None
    moved = real.replace("kind  state", "state  kind")
    assert "does not match" in mismatch(PS.splitlines(), moved)
    assert mismatch(["wrote /tmp/a/demo-model"], "wrote /work/x/y/demo-model\n") is None
    assert mismatch(["━━━━┓"], "\x1b[1m━━━━━━━━┓\x1b[0m\n") is None
    assert mismatch(["cgroup: 634.7 MiB used"], "cgroup: 2.7 GiB used\n") is None
    assert mismatch(["0  +0.0000  3337"], "0  -0.0857  272\n") is None
    assert mismatch(["marker areal-t0-659fa574"], "marker areal-t0-0690cb14\n") is None


def test_ellipsis_lines_and_ellipsis_in_a_line():
    want = ["first", "...", "last 3"]
    assert mismatch(want, "first\nlast 4\n") is None
    assert mismatch(want, "first\na\nb\nlast 9\n") is None
    assert "'last 3'" in mismatch(want, "first\na\n")
    assert mismatch(["error: ... not found"], "error: model /x/y not found\n") is None
    assert mismatch(["only"], "only\nmore\n") is not None  # nothing unshown may follow


WALK = """\
# a walk

```console
$ areal serve --backend hf --model demo-model --detach
ready default/trial0: 1 server(s) healthy and registered
  http://127.0.0.1:30000  pid 1  gpus cpu  log /x/server-0.log
stop with: areal stop default/trial0
```

The next block prints something else than the manual says:

```console
$ areal alloc hf:d2
hf:d2 is two servers
```

```
areal ps
```

```python
import os
print(os.environ["AREAL_HOME"])
```

A job config goes through a dry run; the second asks for what FSDP refuses:

```yaml
backend: hf
model: /models/m
alloc: hf:d2
```

```yaml
alloc: fsdp:d2p2
min_servers: 2
```

A process `areal stop` knows nothing of:

```bash
nohup sleep 600 > /dev/null 2>&1 &
```
"""


@pytest.mark.slow
def test_a_walk_over_a_page(tmp_path):
    """A server a block starts serves the page's later blocks and is stopped at the page's
    end; an example that prints otherwise, an unmarked block and a job YAML that `--dry-run`
    refuses fail; what the page started and `areal stop` does not know fails the page's end,
    and is killed."""
    (tmp_path / "README.md").write_text(WALK)
    report = tmp_path / "report.xml"
    env = {**os.environ, "AREAL_DOCS_ROOT": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         f"--junitxml={report}", "--durations", "5", "tests/docs/test_manual.py"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    outcome = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name").removeprefix("test_block[").removesuffix("]")
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome[name] = "failed" if failed else "passed"
    assert outcome == {
        "README.md:3": "passed",
        "README.md:12": "failed",
        "README.md:17": "failed",
        "README.md:21": "passed",
        "README.md:28": "passed",
        "README.md:34": "failed",
        "README.md:41": "passed",
        "README.md:end": "failed",
    }, res.stdout[-4000:]
    left = res.stdout[res.stdout.index("README.md left processes behind") :]
    assert "sleep 600" in left and "areal_cli" not in left
    assert "'hf:d2 is two servers' does not match" in res.stdout
