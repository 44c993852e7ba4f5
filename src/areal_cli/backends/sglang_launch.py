"""Start SGLang with its API key in a --config file instead of on its command line.

    AREAL_SERVER_API_KEY=... python -m areal_cli.backends.sglang_launch -- \\
        PYTHON -m sglang.launch_server ARGS...

SGLang 0.5.23 takes its key only as `--api-key KEY` (srt/arg_groups/fields/serving.py:160)
or from a YAML file given with `--config` (srt/server_args.py:400-405, 683-689), which it
reads once, at start, after checking that the name ends in .yaml and exists
(srt/utils/server_args_config_parser.py). This launcher takes the key out of its
environment, makes a FIFO named config.yaml in a folder only this user can enter, and
execs SGLang (same pid) with `--config` pointing at it; a detached child writes the YAML
into the FIFO when SGLang opens it, then removes FIFO and folder. The key lands neither on
a disk nor in any process's argv. A `--config` of the user's own is merged into that YAML
(its keys, then the key). SGLang turns each YAML key into `--KEY` as written
(server_args_config_parser.py `_add_scalar_arg`), so the key is spelled `api-key`, the
flag's own spelling.

Without the variable it execs the command unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile

KEY_ENV = "AREAL_SERVER_API_KEY"
# The writer gives up (and removes the FIFO) if SGLang never opens it: it failed to start.
WRITE_TIMEOUT_S = 600


def config_text(key: str, argv: list[str]) -> tuple[str, list[str]]:
    """The YAML to feed SGLang and the command line without the user's own --config."""
    import yaml

    config: dict = {}
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise SystemExit("sglang_launch: --config needs a file")
        with open(argv[i + 1]) as f:
            config = yaml.safe_load(f) or {}
        if not isinstance(config, dict):
            raise SystemExit(f"sglang_launch: {argv[i + 1]} does not hold a mapping")
        argv = argv[:i] + argv[i + 2 :]
    config.pop("api_key", None)
    config["api-key"] = key
    return yaml.safe_dump(config), argv


def _write_once(fifo: str, folder: str, text: str) -> None:
    """Fork a writer that outlives the exec: it blocks until SGLang opens the FIFO for
    reading, writes `text`, and cleans up. Double-forked, so it is nobody's zombie."""
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        if os.fork():
            os._exit(0)

        def give_up(*_):
            _cleanup(fifo, folder)
            os._exit(1)

        signal.signal(signal.SIGALRM, give_up)
        signal.alarm(WRITE_TIMEOUT_S)
        fd = os.open(fifo, os.O_WRONLY)
        _cleanup(fifo, folder)  # the open FIFO needs no name any more
        data = text.encode()
        while data:
            data = data[os.write(fd, data) :]
        os.close(fd)
        os._exit(0)
    except BaseException:
        os._exit(1)


def _cleanup(fifo: str, folder: str) -> None:
    for fn, path in ((os.unlink, fifo), (os.rmdir, folder)):
        try:
            fn(path)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m areal_cli.backends.sglang_launch -- COMMAND...", file=sys.stderr)
        sys.exit(2)
    key = os.environ.pop(KEY_ENV, None)
    if key:
        text, args = config_text(key, args)
        folder = tempfile.mkdtemp(prefix="areal-sglang-")  # mode 700
        fifo = os.path.join(folder, "config.yaml")
        os.mkfifo(fifo, 0o600)
        _write_once(fifo, folder, text)
        args = [*args, "--config", fifo]
    sys.stdout.flush()
    os.execvp(args[0], args)


if __name__ == "__main__":
    main()
