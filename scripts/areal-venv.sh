#!/usr/bin/env bash
# Build AReaL 1.0.4's own virtualenv (its trainer, as an AReaL user installs it) once per
# machine, outside the repository, for the `areal` test tier (`make areal`):
#
#   $AREAL_ENGINES/areal    AReaL 1.0.4 over torch 2.13.0+cpu
#
# AReaL pins torch<2.11 (a multi-GB CUDA build from the index) and many packages its
# trainer never imports (agent frameworks, Megatron, vLLM/SGLang runtimes). So: torch
# 2.13.0 (the CPU wheel on this disk) first, then AReaL without its dependencies, then
# AReaL's own requirement lines (pins included) for the modules its trainer's import chain
# needs (PPOTrainer, FSDPEngine, RemoteSGLangEngine, RLVRWorkflow, load_expr_config), each
# constrained to keep this torch.
#
# AReaL's trainer reads sglang's package *metadata* even though it only speaks HTTP to
# remote servers (areal/api/cli_args.py, SGLangConfig.build_args checks sglang's version):
# `pip install --no-deps sglang==<AReaL's pin>` is the lightest way to have it (the package's
# own files, none of its CUDA dependencies).
#
# AREAL_ENGINES defaults to /var/cache/areal-engines. A venv whose stamp matches this script
# is left as it is; any other is (re)built. A failed step stops the build with its name and
# the last lines pip printed, and leaves no stamp.
set -euo pipefail

ROOT=${AREAL_ENGINES:-/var/cache/areal-engines}
PY=${PY:-python3}
VENV=$ROOT/areal
TORCH=torch==2.13.0 # the CPU wheel on this disk; an unpinned torch would pull a CUDA one
AREAL=areal==1.0.4
STAMP_NAME=.areal-venv

# Distributions the trainer's import chain needs (found by importing what a GRPO script
# imports, one missing module at a time), installed at the versions AReaL's metadata asks.
CHAIN=(
    aiohttp aiofiles transformers datasets omegaconf hydra-core torchdata pydantic
    pyyaml packaging orjson msgspec pybase64 psutil uvloop httpx pyzmq regex tabulate
    colorlog colorama einops setproctitle networkx tensorboardx tenacity flask lark
    ray numba pillow swanlab trackio wandb peft
)
# Imported by the chain but not among AReaL's declared requirements (others of them bring it).
EXTRA=(numpy openai)

fail() {
    echo "areal-venv: $*" >&2
    exit 1
}

# step NAME COMMAND...: run it quietly, show its output only when it fails.
step() {
    local name=$1 log
    shift
    log=$(mktemp)
    echo "areal-venv: $name" >&2
    if ! nice "$@" >"$log" 2>&1; then
        grep -v "is ignored: it is neither" "$log" | tail -25 >&2
        rm -f "$log"
        fail "step failed: $name"
    fi
    rm -f "$log"
}

# AReaL's requirement lines (markers evaluated for this platform) for the names given, less
# their extras (ray[default], swanlab[dashboard]): the trainer imports the packages only.
requirements() {
    "$VENV/bin/python" - "$@" <<'EOF'
import re, sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

wanted = {re.sub(r"[-_.]+", "-", n).lower() for n in sys.argv[1:]}
found = set()
for line in requires("areal") or []:
    req = Requirement(line)
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if name in wanted:
        found.add(name)
        print(f"{req.name}{req.specifier}")
missing = wanted - found
if missing:
    sys.exit(f"not among AReaL's requirements: {', '.join(sorted(missing))}")
EOF
}

# The SGLang version AReaL's `sglang` extra pins.
sglang_pin() {
    "$VENV/bin/python" - <<'EOF'
import re
from importlib.metadata import requires

for line in requires("areal") or []:
    m = re.match(r"sglang(\[[^\]]*\])?\s*==\s*([^;\s]+)", line)
    if m:
        print(m.group(2))
        break
EOF
}

fingerprint() {
    sha256sum "$0" | cut -c1-16
}

build() {
    local pin
    rm -f "$VENV/$STAMP_NAME"
    test -x "$VENV/bin/python" || step "create $VENV" "$PY" -m venv "$VENV"
    step "$TORCH" "$VENV/bin/pip" install -q "$TORCH"
    echo "$TORCH" >"$VENV/constraints.txt"
    step "$AREAL (no dependencies)" "$VENV/bin/pip" install -q --no-deps "$AREAL"
    requirements "${CHAIN[@]}" >"$VENV/requirements.txt" || fail "AReaL's requirements changed"
    printf '%s\n' "${EXTRA[@]}" >>"$VENV/requirements.txt"
    step "the trainer's requirements" "$VENV/bin/pip" install -q -r "$VENV/requirements.txt" \
        -c "$VENV/constraints.txt"
    pin=$(sglang_pin)
    [[ -n $pin ]] || fail "AReaL's metadata pins no sglang version"
    step "sglang==$pin's metadata (no dependencies)" "$VENV/bin/pip" install -q --no-deps \
        "sglang==$pin"
    step "import AReaL's trainer" env AREAL_SPMD_MODE=1 "$VENV/bin/python" -c \
        "import areal; from areal import PPOTrainer; from areal.api.cli_args import GRPOConfig
import areal.engine.fsdp_engine, areal.engine.sglang_remote, areal.workflow.rlvr"
}

mkdir -p "$ROOT" || fail "cannot create $ROOT (set AREAL_ENGINES to a folder you can write)"
want=$(fingerprint)
if [[ -f $VENV/$STAMP_NAME && $(cat "$VENV/$STAMP_NAME") == "$want" ]]; then
    echo "areal-venv: $VENV is built ($VENV/bin/python)" >&2
    exit 0
fi
start=$SECONDS
build
echo "$want" >"$VENV/$STAMP_NAME"
echo "areal-venv: $VENV built in $((SECONDS - start)) s ($VENV/bin/python)" >&2
