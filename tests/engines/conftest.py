"""The engines tier: every test here is marked `engines` (skipped without the CPU builds of
`make engines`, failed instead when AREAL_REQUIRE_ENGINES=1, see tests/services.py).

Fixtures every module of the tier shares, each made once per module that asks for it: the
tiny model (init-model's default shape: heads of 32, the smallest vLLM's CPU attention
takes, v1/attention/backends/cpu_attn.py:69-70; 16 crashed its first request) and one
server per engine under `areal serve --detach --python <venv>`, an API key as by default,
stopped at the end of the module."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_cli.modelgen import create_tiny_model
from tests.engines.engines import EngineServer


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def _served(engine: str, model: Path, tmp_path_factory):
    srv = EngineServer.start(engine, model, tmp_path_factory.mktemp(engine))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def sglang(model, tmp_path_factory):
    yield from _served("sglang", model, tmp_path_factory)


@pytest.fixture(scope="module")
def vllm(model, tmp_path_factory):
    yield from _served("vllm", model, tmp_path_factory)
