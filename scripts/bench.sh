#!/usr/bin/env bash
# scripts/bench.sh -- the epifuse benchmark: `python -m benchmarks ARGS` (benchmarks/).
#
#   scripts/bench.sh                         # everything at KernelBench sizes (GPU)
#   scripts/bench.sh --quick --no-compile    # a fast smoke run
#   scripts/bench.sh --device cpu --quick    # dry run without a GPU (tiny sizes)
#   scripts/bench.sh --markdown BENCHMARKS.md
#   scripts/bench.sh --problems 84 39 --dtype amp   # torch.autocast columns (amp-bf16, amp-fp16)
#   python -m benchmarks.report bench-out/bench.json --markdown BENCHMARKS.md   # report again
#   scripts/bench.sh --help                  # all options
#
# Assumes epifuse was built (and installed) by scripts/build.sh. The working
# tree's python/ is used when its compiled library is there (build.sh puts it
# there), so the benchmark always matches the checkout. Runs from any folder;
# output: bench-out/ in the repository (or --out).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# --help: the comment block above, without building, installing or writing anything.
usage() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
for arg in "$@"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then
    usage
    printf '\nOptions (python -m benchmarks --help):\n'
    "$ROOT/scripts/_module_help.sh" benchmarks
    exit 0
  fi
done
cd "$ROOT"

PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || { echo "[epifuse] error: python interpreter '$PY' not found (set PYTHON=...)" >&2; exit 1; }
if [[ -f "$ROOT/python/epifuse/lib/libepifuse_ops.so" ]]; then
  export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! err="$("$PY" -c 'import epifuse, benchmarks.cases' 2>&1)"; then
  printf '%s\n' "$err" | tail -n 5 >&2
  echo "[epifuse] error: cannot import epifuse with $PY. Build and install it first: scripts/build.sh" >&2
  exit 1
fi
export EPIFUSE_BENCH_CMD="scripts/bench.sh"
exec "$PY" -m benchmarks "$@"
