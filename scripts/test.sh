#!/usr/bin/env bash
# scripts/test.sh -- set up + build (scripts/build.sh), then the test suite (tests/; the
# scripts in examples/ run in tests/test_examples.py).
# Arguments are passed to pytest (e.g. scripts/test.sh -k fold -x); after `--` they are passed
# as they are (scripts/test.sh -- --help shows pytest's own help, after the build).
# -h / --help prints this text and does nothing else.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# --help: the comment block above, without building, installing or writing anything.
usage() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
for arg in "$@"; do
  [[ "$arg" == -- ]] && break
  if [[ "$arg" == -h || "$arg" == --help ]]; then usage; exit 0; fi
done
if [[ "${1:-}" == -- ]]; then shift; fi
cd "$ROOT"
"$ROOT/scripts/build.sh"
PY="$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')"
if ! "$PY" -c 'import pytest' 2>/dev/null; then
  echo "[epifuse] pytest not found; pip install pytest"
  extra=()
  if [[ -n "${EPIFUSE_WHEELHOUSE:-}" ]]; then extra=(--no-index --find-links "$EPIFUSE_WHEELHOUSE"); fi
  "$PY" -m pip install --disable-pip-version-check "${extra[@]}" pytest
fi
echo "[epifuse] test: python -m pytest tests -ra $*"
set +e
"$PY" -m pytest tests -ra "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  # pytest's "no tests collected" (e.g. a -k that matches nothing) is not a failure of the suite
  # but must not pass silently either: report it and fail with a normal error code.
  echo "[epifuse] error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
