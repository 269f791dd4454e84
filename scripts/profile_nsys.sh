#!/usr/bin/env bash
# scripts/profile_nsys.sh -- profile ModelNew under Nsight Systems, with NVTX ranges.
#
#   scripts/profile_nsys.sh [PROBLEM] [train|eval] [--dtype D] [--precision P] [--batch N]
#                           [--iters N] [--warmup N] [--model new|ref] [--out DIR]
#   default: 84 train --dtype fp32 --precision tf32, output ./profile-out
#   PROBLEM, D and P are spelled as for `python -m epifuse` (84, 39, gemm_scale_bn; fp32, bf16,
#   fp16, fp32-tf32, amp-bf16; ieee, 3xtf32, tf32, highest, high): scripts/profile_driver.py
#   checks them against epifuse.cli's table.
#
# Writes DIR/p<problem>_<mode>_<dtype>_<model>.nsys-rep and prints `nsys stats`
# (cuda_gpu_kern_sum, nvtx_sum). The package emits NVTX ranges per stage (GEMM,
# fold, softmax) because EPIFUSE_NVTX=1 is set here.
# nsys is taken from $NSYS, PATH, or the usual install folders. Without nsys (or
# when its report import fails) it falls back to torch.profiler: same per-kernel
# table, plus a Chrome trace. EPIFUSE_PROFILE_FORCE_FALLBACK=1 forces the fallback.
# Does not build: run scripts/build.sh first (EPIFUSE_PROFILE_BUILD=1 makes it do so).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ORIG_PWD="$PWD"
cd "$ROOT"

say() { printf '[profile] %s\n' "$*"; }
# --help: the comment block above, without building, installing or writing anything.
usage() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

out="$ORIG_PWD/profile-out"
pass=()  # everything but --out goes to the driver, which reads the words through epifuse.cli
while (($#)); do
  case "$1" in
    --out|-o) out="$2"; shift ;;
    --out=*) out="${1#--out=}" ;;
    -h|--help) usage; exit 0 ;;
    *) pass+=("$1") ;;
  esac
  shift
done
case "$out" in /*) ;; *) out="$ORIG_PWD/$out" ;; esac
mkdir -p "$out"

if [[ "${EPIFUSE_PROFILE_BUILD:-0}" == 1 ]]; then "$ROOT/scripts/build.sh"; fi
PY="$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')"
export EPIFUSE_NVTX=1
DRIVER=("$PY" "$ROOT/scripts/profile_driver.py" "${pass[@]}")

fallback() {
  say "falling back to torch.profiler"
  exec "${DRIVER[@]}" --profiler torch --out "$out"
}

find_nsys() {
  if [[ -n "${NSYS:-}" ]]; then
    if [[ -x "$NSYS" ]]; then echo "$NSYS"; return 0; fi
    say "NSYS=$NSYS is not executable; searching elsewhere" >&2
  fi
  if command -v nsys >/dev/null 2>&1; then command -v nsys; return 0; fi
  local c
  for c in /usr/local/cuda/bin/nsys \
           /opt/nvidia/nsight-systems/*/bin/nsys \
           /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys \
           /usr/local/cuda-*/bin/nsys \
           /usr/local/cuda/nsight-systems-*/bin/nsys \
           /usr/lib/nsight-systems/bin/nsys; do
    if [[ -x "$c" ]]; then echo "$c"; return 0; fi
  done
  return 1
}

LIBDW_FIX="nsys could not import its recording (a .qdstrm but no .nsys-rep); the usual cause is a missing
  libdw.so.1 / libelf.so.1 for nsys's QdstrmImporter. Fix: apt-get install libdw1 libelf1, or without root
  (the .debs can be fetched on another machine: apt-get download libdw1 libelf1):
    for d in libdw1_*.deb libelf1_*.deb; do dpkg -x \$d $ROOT/.offline/nsys-libs; done
  This script puts $ROOT/.offline/nsys-libs/usr/lib/x86_64-linux-gnu on LD_LIBRARY_PATH itself
  (or set EPIFUSE_NSYS_LIBDIR=<folder with libdw.so.1>)."

# Extra libraries for nsys (libdw/libelf extracted from .debs, see LIBDW_FIX).
for d in "${EPIFUSE_NSYS_LIBDIR:-}" "$ROOT/.offline/nsys-libs/usr/lib/x86_64-linux-gnu" \
         "$ROOT/.offline/nsys-libs/lib/x86_64-linux-gnu"; do
  if [[ -n "$d" && -d "$d" ]]; then
    export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
done

if [[ "${EPIFUSE_PROFILE_FORCE_FALLBACK:-0}" == 1 ]]; then
  say "EPIFUSE_PROFILE_FORCE_FALLBACK=1"
  fallback
fi
if ! NSYS_BIN="$(find_nsys)"; then
  say "Nsight Systems (nsys) not found (looked at \$NSYS, PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-systems/*/bin)."
  say "Install Nsight Systems or set NSYS=/path/to/nsys for the .nsys-rep."
  fallback
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  say "no CUDA device visible to torch: nothing for nsys to record"
  fallback
fi

# Pre-flight: the package imports, the words are known and the model builds (else report that,
# once); its last line is the report's name.
check="$("${DRIVER[@]}" --check)" || exit 1
name="$(printf '%s\n' "$check" | tail -n 1 | tr -d '\n' | tr -c 'A-Za-z0-9_.=-' '_')"
rep="$out/$name"
log="$out/$name.nsys.log"

say "nsys: $NSYS_BIN ($("$NSYS_BIN" --version 2>/dev/null | head -n1))"
say "recording -> $rep.nsys-rep"
set +e
"$NSYS_BIN" profile --trace=cuda,nvtx --sample=none --cpuctxsw=none \
  --capture-range=cudaProfilerApi --capture-range-end=stop \
  --force-overwrite=true --output="$rep" \
  "${DRIVER[@]}" --profiler nsys 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if [[ $rc -ne 0 || ! -f "$rep.nsys-rep" ]]; then
  if [[ -f "$rep.qdstrm" ]] || grep -q -E 'libdw|libelf|Importer error' "$log"; then say "$LIBDW_FIX"; fi
  say "nsys profile failed (exit $rc; log $log)"
  fallback
fi

say "nsys stats: cuda_gpu_kern_sum, nvtx_sum"
set +e
"$NSYS_BIN" stats --force-export=true --report cuda_gpu_kern_sum --report nvtx_sum "$rep.nsys-rep" > "$log.stats" 2>&1
rc=$?
set -e
if [[ $rc -ne 0 ]]; then
  # older nsys spell the reports gpukernsum / nvtxsum
  set +e
  "$NSYS_BIN" stats --force-export=true --report gpukernsum --report nvtxsum "$rep.nsys-rep" > "$log.stats" 2>&1
  rc=$?
  set -e
fi
cat "$log.stats"
if [[ $rc -ne 0 ]]; then
  if grep -q -E 'libdw|libelf' "$log.stats"; then say "$LIBDW_FIX"; fi
  say "nsys stats failed (exit $rc); the report is still at $rep.nsys-rep (open it in the Nsight Systems GUI)"
  fallback
fi
say "report: $rep.nsys-rep"
