#!/usr/bin/env bash
# scripts/_module_help.sh MODULE -- print `python -m MODULE --help` for run.sh / bench.sh --help
# (benchmarks: the checkout's benchmarks/ folder, run from the repository root).
#
# Reads only: the checkout's python/ when its library is built there, else an installed
# epifuse; without either, says how to build instead of failing (no bytecode is written).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
  epifuse|benchmarks) ;;
  -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
  *) echo "usage: scripts/_module_help.sh epifuse|benchmarks" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3}"
if [[ -f "$ROOT/python/epifuse/lib/libepifuse_ops.so" ]]; then
  export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
fi
cd "$ROOT"
if ! PYTHONDONTWRITEBYTECODE=1 "$PY" -m "$1" --help 2>/dev/null; then
  echo "  (epifuse is not built yet, so its options cannot be listed: scripts/build.sh builds it)"
fi
exit 0
