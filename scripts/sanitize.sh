#!/usr/bin/env bash
# scripts/sanitize.sh [OUTDIR] -- compute-sanitizer (memcheck, racecheck, initcheck, synccheck)
# over scripts/sanitize_driver.py: every epifuse op and both ModelNew problems on small shapes.
#
# Prints one line per tool ("memcheck: 0 errors (41s)") and exits non-zero if any tool reports
# an error, the driver's value checks fail, or a tool could not run. Full logs: OUTDIR/<tool>.log
# (default ./sanitize-out).
#
# Environment:
#   EPIFUSE_SANITIZE_TOOLS    tools to run (default "memcheck racecheck initcheck synccheck")
#   EPIFUSE_SANITIZE_DRY=1    run the driver once without the sanitizer (CPU: it skips, exit 0)
#   EPIFUSE_SANITIZE_TIMEOUT  seconds per tool (default 900)
#   EPIFUSE_SANITIZE_ARGS     extra compute-sanitizer arguments (e.g. "--kernel-regex kns=epifuse")
#   COMPUTE_SANITIZER         path of compute-sanitizer (else PATH, $CUDA_HOME/bin,
#                             /usr/local/cuda/bin, /opt/nvidia/...)
#   PYTHON                    interpreter (default python3)
#
# -h / --help prints this text.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# --help: the comment block above, without building, installing or writing anything.
usage() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
OUT=""
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    -*) echo "[sanitize] error: unknown option '$arg' (see --help)" >&2; exit 2 ;;
    *) [[ -z "$OUT" ]] || { echo "[sanitize] error: one OUTDIR only (see --help)" >&2; exit 2; }
       OUT="$arg" ;;
  esac
done
OUT="${OUT:-$PWD/sanitize-out}"
PY="${PYTHON:-python3}"
DRIVER="$ROOT/scripts/sanitize_driver.py"
TOOLS="${EPIFUSE_SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}"
TIMEOUT="${EPIFUSE_SANITIZE_TIMEOUT:-900}"

if [[ "${EPIFUSE_SANITIZE_DRY:-0}" == "1" ]]; then
  echo "[sanitize] dry run: $PY $DRIVER --quick (no sanitizer)"
  exec "$PY" "$DRIVER" --quick
fi

find_sanitizer() {
  local c
  for c in "${COMPUTE_SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)" \
           "${CUDA_HOME:+$CUDA_HOME/bin/compute-sanitizer}" /usr/local/cuda/bin/compute-sanitizer \
           /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    if [[ -n "$c" && -x "$c" ]]; then echo "$c"; return 0; fi
  done
  if [[ -d /opt/nvidia ]]; then
    c="$(find /opt/nvidia -name compute-sanitizer -type f -perm -u+x 2>/dev/null | sort | tail -n 1)"
    if [[ -n "$c" ]]; then echo "$c"; return 0; fi
  fi
  return 1
}

SAN="$(find_sanitizer)" || {
  echo "[sanitize] error: compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin," \
       "/opt/nvidia); set COMPUTE_SANITIZER=/path/to/compute-sanitizer" >&2
  exit 2
}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "[sanitize] error: no CUDA GPU visible to $PY (use EPIFUSE_SANITIZE_DRY=1 for a dry run)" >&2
  exit 2
fi
mkdir -p "$OUT"
echo "[sanitize] $("$SAN" --version 2>/dev/null | grep -m1 -i version); logs in $OUT"

# The caching allocator hands out sub-ranges of big blocks: an out-of-bounds access that stays
# inside its block is invisible to memcheck. Without it every tensor is its own cudaMalloc.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
export PYTHONUNBUFFERED=1

status=0
for tool in $TOOLS; do
  args=(--tool "$tool" --error-exitcode 1 --show-backtrace device)
  driver_args=()
  case "$tool" in
    memcheck) ;;
    racecheck) args+=(--racecheck-report hazard); driver_args+=(--quick) ;;  # slowest tool
    initcheck) ;;
    synccheck) ;;
    *) echo "[sanitize] unknown tool '$tool'" >&2; status=1; continue ;;
  esac
  # shellcheck disable=SC2206  # word-splitting of the extra arguments is intended
  extra=(${EPIFUSE_SANITIZE_ARGS:-})
  log="$OUT/$tool.log"
  start=$SECONDS
  timeout "$TIMEOUT" "$SAN" "${args[@]}" "${extra[@]}" "$PY" "$DRIVER" "${driver_args[@]}" \
    >"$log" 2>&1
  rc=$?
  secs=$((SECONDS - start))
  # "ERROR SUMMARY: 3 errors" (memcheck/initcheck/synccheck), "RACECHECK SUMMARY: 2 hazards
  # displayed (1 error, 1 warning)" (racecheck)
  errors="$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$log" | grep -Eo '[0-9]+' | tail -n 1)"
  if [[ -z "$errors" ]]; then
    errors="$(grep -Eo 'RACECHECK SUMMARY: .*\(([0-9]+) error' "$log" | grep -Eo '\([0-9]+' |
              tr -d '(' | tail -n 1)"
  fi
  driver_ok=1
  grep -q 'VALUE CHECK FAILED' "$log" && driver_ok=0
  if [[ $rc -eq 124 ]]; then
    echo "$tool: TIMEOUT after ${TIMEOUT}s (log: $log)"
    status=1
  elif [[ -z "$errors" ]]; then
    echo "$tool: FAILED to run (exit $rc, no sanitizer summary; log: $log)"
    tail -n 5 "$log" | sed 's/^/    /'
    status=1
  elif [[ "$errors" != "0" || $rc -ne 0 || $driver_ok -eq 0 ]]; then
    note=""
    [[ $driver_ok -eq 0 ]] && note=", driver value checks FAILED"
    echo "$tool: $errors errors (exit $rc$note, ${secs}s; log: $log)"
    grep -m 5 -E '^========= (Invalid|Uninitialized|Race|Barrier|Error|.*hazard)' "$log" |
      sed 's/^/    /'
    [[ $driver_ok -eq 0 ]] && grep -m 5 'VALUE CHECK FAILED' "$log" | sed 's/^/    /'
    status=1
  else
    echo "$tool: 0 errors (${secs}s)"
  fi
done
exit "$status"
