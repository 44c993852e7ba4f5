"""The worker context this process joined with (`runtime.connect()` sets it, its close clears
it): what the modules under the runtime (consistency, checkpoint) read without importing it,
so imports go one way."""

from __future__ import annotations

from typing import Any

# The runtime's WorkerContext, None until connect() and after close().
CURRENT: Any = None
