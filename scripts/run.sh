#!/usr/bin/env bash
# scripts/run.sh -- the main job: set up + build (scripts/build.sh), then run both
# problems (84: gemm_bn_scale_softmax, 39: gemm_scale_bn), ModelNew vs Model.
# Arguments are passed to `python -m epifuse`. On a machine without a Hopper GPU
# the package runs its reference (CPU) path at a small size and says so.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
"$ROOT/scripts/build.sh"
PY="$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')"
echo "[epifuse] run: python -m epifuse $*"
exec "$PY" -m epifuse "$@"
