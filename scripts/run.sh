#!/usr/bin/env bash
# scripts/run.sh -- the main job: set up + build (scripts/build.sh), then run both
# problems (84: gemm_bn_scale_softmax, 39: gemm_scale_bn), ModelNew vs Model.
# Arguments are passed to `python -m epifuse`. On a machine without a Hopper GPU
# the package runs its reference (CPU) path at a small size and says so.
#
#   scripts/run.sh --problem 84 --dtype bf16     # one problem, one dtype
#   scripts/run.sh --help                        # this text and python -m epifuse's options
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# --help: the comment block above, without building, installing or writing anything.
usage() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
for arg in "$@"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then
    usage
    printf '\nOptions (python -m epifuse --help):\n'
    "$ROOT/scripts/_module_help.sh" epifuse
    exit 0
  fi
done
cd "$ROOT"
"$ROOT/scripts/build.sh"
PY="$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')"
echo "[epifuse] run: python -m epifuse $*"
exec "$PY" -m epifuse "$@"
