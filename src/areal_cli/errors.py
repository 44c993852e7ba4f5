"""Typed errors. The library raises these; the CLI maps them to messages and exit codes.

Exit codes (one table for every command):
    0 ok · 1 a launched process failed · 2 bad usage, config or input ·
    3 timed out (health, discovery) · 130 interrupted
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_INTERRUPTED = 130


class ArealError(Exception):
    """Base of every error the tool reports to a user. `hint` says what to do about it."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, hint: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        # Extra lines shown under the message (a log tail, a caret diagram).
        self.detail = detail


class ArealWarning(UserWarning):
    """Something the user should know that stops nothing: the CLI shows it as one line."""


class UsageError(ArealError):
    """Bad flags, config, allocation, paths: exit 2."""

    exit_code = EXIT_USAGE


class LaunchError(ArealError):
    """A process the tool launched failed: exit 1."""

    exit_code = EXIT_FAILED


class WaitTimeout(ArealError):
    """Health or discovery did not happen in time: exit 3."""

    exit_code = EXIT_TIMEOUT
