# The README's commands: `make demo` and `make test` work on a fresh machine.
PY      ?= python3
VENV    ?= .venv
# CPU build by default; override for CUDA, e.g. make install TORCH='torch==2.13.0 --index-url ...'
TORCH   ?= torch==2.13.0
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install demo test test-docs test-engines engines areal test-areal lint format bench docs clean

install: $(STAMP)

# The editable install is a plain path to src/ (compat mode), not setuptools' default import
# finder: that finder is imported by every interpreter of the venv (16-20 ms of CPU each,
# `python -c pass` 28 ms against 12 ms). src/areal_cli/commands and src/areal_cli/templates
# are links to commands/ and templates/, so that path finds them; the wheel is built from
# pyproject's package-dir as before, and holds the same files.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]" --config-settings editable_mode=compat
	touch $(STAMP)

demo: install
	bash scripts/demo.sh

# Three workers on two cores: many tests wait on processes. Bytecode is cached (whatever
# PYTHONDONTWRITEBYTECODE says) because the tests start hundreds of interpreters. The real
# engines' tier is `make test-engines`. A failed test runs once more (--reruns 1): tests that
# time real processes on two shared cores can miss a deadline under load; both results print.
# The 15 slowest tests print at the end: what to look at when the suite grows slower.
test: install lint
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 3 --dist loadfile --reruns 1 --durations 15 -m "not engines and not areal and not docs"

# The CPU builds of SGLang 0.5.23 and vLLM 0.32 in $$AREAL_ENGINES (default
# /var/cache/areal-engines), outside the checkout so every checkout on the machine reuses them.
engines:
	bash scripts/engines.sh

# The real engines under `areal serve`, one engine server at a time (each takes ~2.7 GB and
# most of the cores while it loads). Skips without `make engines`; AREAL_REQUIRE_ENGINES=1 fails.
test-engines: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q --reruns 1 -m engines tests/engines tests/conformance

# AReaL 1.0.4's own venv (its trainer over torch 2.13.0+cpu) in $$AREAL_ENGINES/areal, built
# once per machine like the engines.
areal:
	bash scripts/areal-venv.sh

# AReaL's own trainer through `areal train --areal-overrides` against `areal serve` (hf, and
# the real SGLang when `make engines` built it). Skips without `make areal`;
# AREAL_REQUIRE_AREAL=1 fails.
test-areal: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q --durations 10 -m areal tests/areal

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	$(BIN)/python benchmarks/run_all.py

# The manual (mkdocs.yml, docs/) as a site in site/; --strict fails on every warning, a link to
# a missing page or anchor among them.
docs: install
	$(BIN)/mkdocs build --strict --site-dir site

# Every block of README.md and docs/*.md run as a reader would (tests/docs/, a page is a
# walk in a sandbox of its own): 2 minutes on a quiet two-core host, 5-7 under load, most of
# it servers and torchrun starting; a tier of its own beside `make test`, which runs the
# harness's own tests.
test-docs: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 3 --dist loadfile --reruns 1 -m docs tests/docs

clean:
	rm -rf $(VENV) build dist site *.egg-info src/*.egg-info
