#!/usr/bin/env bash
# rollart's device check: every GPU path, ONE JSON summary on stdout (all steps: ~12+ minutes on one H200;
# --budget-s bounds a run, --only picks steps: docs/gpus.md says how to split it).
#   bash scripts/gpu_check.sh [--no-gpu] [--quick] [--out DIR] [--steps N] [--budget-s S] [--only STEP ...]
# On a bare GPU machine (docs/gpus.md, "Checking a GPU machine"): bring .devbundle along and run
#   source .devbundle/setup.sh && bash scripts/gpu_check.sh --out "$OUT"
# Without a GPU every GPU step is reported "skipped" and the CPU-safe ones run (CI: --no-gpu --quick).
# The steps and what each checks: scripts/gpu_check.py. Exit status 0 when every step that ran passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" scripts/gpu_check.py "$@"
