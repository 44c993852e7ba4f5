#!/usr/bin/env bash
# `make demo`: the main job on CPU — a tiny model, an hf server, GRPO training against it,
# the reward curve, a clean stop. Everything lives under ./demo-model and the demo trial.
set -euo pipefail
cd "$(dirname "$0")/.."
AREAL=.venv/bin/areal
EXP=demo
TRIAL=run$(date +%s)
export AREAL_HOME=${AREAL_HOME:-$PWD/.demo/home}
export AREAL_REGISTRY=${AREAL_REGISTRY:-$PWD/.demo/registry}

cleanup() { $AREAL stop "$EXP/$TRIAL" >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "== 1. a tiny random-weight model (nothing is downloaded)"
$AREAL init-model demo-model --force

echo "== 2. one hf inference server on CPU, registered under $EXP/$TRIAL"
$AREAL serve --backend hf --model demo-model --experiment "$EXP" --trial "$TRIAL" --detach

echo "== 3. GRPO training with two FSDP ranks (gloo), servers found in the registry"
start=$(date +%s)
$AREAL train --alloc fsdp:d2 --experiment "$EXP" --trial "$TRIAL" \
  templates/grpo/train.py --config templates/grpo/tiny_cpu.yaml
echo "training took $(( $(date +%s) - start ))s"

echo "== 4. reward curve"
.venv/bin/python templates/grpo/plot.py "$AREAL_HOME/logs/$(id -un)/$EXP/$TRIAL/metrics.jsonl"

echo "== 5. stop the server"
$AREAL stop "$EXP/$TRIAL"
trap - EXIT
# Anything that inherited the demo's AREAL_HOME and still runs would be a leak.
.venv/bin/python - <<'PY'
import os, sys, psutil
home = os.environ["AREAL_HOME"]
left = []
for p in psutil.process_iter():
    try:
        if p.pid != os.getpid() and p.environ().get("AREAL_HOME") == home:
            left.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
    except psutil.Error:
        pass
if left:
    sys.exit("left behind:\n" + "\n".join(left))
PY
echo "nothing left running. done."
