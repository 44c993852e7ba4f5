# The README's commands: `make demo` and `make test` work on a fresh machine.
PY      ?= python3
VENV    ?= .venv
# CPU build by default; override for CUDA, e.g. make install TORCH='torch==2.13.0 --index-url ...'
TORCH   ?= torch==2.13.0
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install demo test lint format bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: install
	bash scripts/demo.sh

# Three workers on two cores: many tests wait on processes. Bytecode is cached (whatever
# PYTHONDONTWRITEBYTECODE says) because the tests start hundreds of interpreters.
test: install lint
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 3 --dist loadfile

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info
