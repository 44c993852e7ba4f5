#!/usr/bin/env bash
# `make demo`: the main job on CPU — a tiny model, an hf server, GRPO training against it,
# the reward curve, a clean stop. Everything lives under ./demo-model and the demo trial.
# Arguments are overrides of the training script, e.g. `bash scripts/demo.sh steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
AREAL=.venv/bin/areal
EXP=demo
TRIAL=run$(date +%s)
export AREAL_HOME=${AREAL_HOME:-$PWD/.demo/home}
export AREAL_REGISTRY=${AREAL_REGISTRY:-$PWD/.demo/registry}
# Marks what this run starts, and only that: its parents (make, a shell, a pipe's grep) may
# carry the same AREAL_HOME, but a process's environment is the one it was started with, so
# the variable exported here is in nothing above this script.
export AREAL_DEMO_RUN="$TRIAL-$$"
MODEL=${AREAL_DEMO_MODEL:-demo-model}

cleanup() { $AREAL stop "$EXP/$TRIAL" >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "== 1. a tiny random-weight model (nothing is downloaded)"
$AREAL init-model "$MODEL" --force

echo "== 2. one hf inference server on CPU, registered under $EXP/$TRIAL"
$AREAL serve --backend hf --model "$MODEL" --experiment "$EXP" --trial "$TRIAL" --detach

echo "== 3. GRPO training with two FSDP ranks (gloo), servers found in the registry"
start=$(date +%s)
$AREAL train --alloc fsdp:d2 --experiment "$EXP" --trial "$TRIAL" \
  templates/grpo/train.py --config templates/grpo/tiny_cpu.yaml "$@"
echo "training took $(( $(date +%s) - start ))s"

echo "== 4. reward curve"
.venv/bin/python templates/grpo/plot.py "$AREAL_HOME/logs/$(id -un)/$EXP/$TRIAL/metrics.jsonl"

echo "== 5. stop the server"
$AREAL stop "$EXP/$TRIAL"
trap - EXIT
# Anything this run started that still runs would be a leak.
.venv/bin/python - <<'PY'
import os, sys, psutil
run = os.environ["AREAL_DEMO_RUN"]
left = []
for p in psutil.process_iter():
    try:
        if p.pid != os.getpid() and p.environ().get("AREAL_DEMO_RUN") == run:
            left.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
    except psutil.Error:
        pass
if left:
    sys.exit("left behind:\n" + "\n".join(left))
PY
echo "nothing left running. done."
