#!/usr/bin/env bash
# scripts/bench.sh -- the epifuse benchmark: `python -m benchmarks ARGS` (benchmarks/).
#
#   scripts/bench.sh --markdown BENCHMARKS.md  # the whole page in one run (GPU machine: ~7-8 min
#                                              # on one H100/H200, ~1-2 min more with 2 GPUs)
#   scripts/bench.sh --device cpu --quick --markdown /tmp/x.md   # dry run without a GPU
#   scripts/bench.sh --quick --no-compile    # a fast smoke run
#   scripts/bench.sh --problems 84 --dtype amp --modes train-step   # a part of it
#   python -m benchmarks.report bench-out/bench.json --markdown BENCHMARKS.md   # report again
#   scripts/bench.sh --help                  # all options
#
# Sections: KernelBench problems 84 and 39 (forwards, training steps; PyTorch's default fp32
# precision, TF32, bf16 and fp16 autocast; vs eager and torch.compile), real heads, softmax, and
# data-parallel steps when the machine has 2 GPUs or more. Each prints its time estimate first.
# Assumes epifuse was built (and installed) by scripts/build.sh. The working tree's python/ is
# used when its compiled library is there (build.sh puts it there), so the benchmark always
# matches the checkout. Runs from any folder; output: bench-out/ in the repository (or --out).
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
