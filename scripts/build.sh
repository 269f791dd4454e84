#!/usr/bin/env bash
# scripts/build.sh -- idempotent set-up + build + install of epifuse.
#
#   1. python (${PYTHON:-python3}) with torch     (the installed one; torch==2.14.1 only if none)
#   2. cmake >= 3.25 and ninja                    (system, else pip)
#   3. CUTLASS 4.2.0 headers                      ($CUTLASS_DIR, else pip nvidia-cutlass==4.2.0.0)
#   4. cmake -S . -B build -G Ninja && cmake --build build   -> python/epifuse/lib/libepifuse_ops.so
#   5. pip install --no-build-isolation --no-deps ./python
#
# The library is built against the torch this python already has, whichever release it is; an
# installed torch is never replaced or upgraded (neither here nor by the wheel, which requires
# torch without a version). Only a python without torch (a fresh machine) gets one installed.
#
# Environment:
#   PYTHON               interpreter to build for (default python3)
#   CUTLASS_DIR          CUTLASS tree (skips the pip package)
#   EPIFUSE_WHEELHOUSE   folder of wheels: pip installs use --no-index --find-links it
#   PIP_NO_INDEX / PIP_FIND_LINKS   honoured by pip itself (offline machines)
#   EPIFUSE_BUILD_JOBS   parallel compile jobs (default: nproc)
#   EPIFUSE_BUILD_DIR    build folder (default build)
#   EPIFUSE_TORCH_SPEC   torch installed when this python has none (default torch==2.14.1)
#
# Takes no arguments; -h / --help prints this text. A full build takes ~8-15 min on 2 cores
# (~2 min with 16 jobs); a rebuild after an edit compiles only what changed.
set -euo pipefail
# --help: the comment block above, without building, installing or writing anything.
usage() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    *) printf '[epifuse] error: build.sh takes no arguments (got %s); see --help\n' "$arg" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

say() { printf '[epifuse] %s\n' "$*"; }
die() { printf '[epifuse] error: %s\n' "$*" >&2; exit 1; }

PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || die "python interpreter '$PY' not found (set PYTHON=...)"
PY="$("$PY" -c 'import sys; print(sys.executable)')"
say "python: $PY ($("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])'))"

CUTLASS_PIN="4.2.0.0"
TORCH_SPEC="${EPIFUSE_TORCH_SPEC:-torch==2.14.1}"
BUILD_DIR="${EPIFUSE_BUILD_DIR:-build}"
JOBS="${EPIFUSE_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"

pip_install() {
  local extra=()
  if [[ -n "${EPIFUSE_WHEELHOUSE:-}" ]]; then
    extra=(--no-index --find-links "$EPIFUSE_WHEELHOUSE")
  fi
  "$PY" -m pip install --disable-pip-version-check "${extra[@]}" "$@"
}
has_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }
dist_version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }

# --- 1. torch ----------------------------------------------------------------
# Build against the torch that is there; install one only where there is none.
if has_module torch; then
  say "torch $(dist_version torch) (installed; building against it)"
else
  say "torch not found; pip install $TORCH_SPEC"
  pip_install "$TORCH_SPEC"
  say "torch $(dist_version torch)"
fi

# --- 2. cmake + ninja ----------------------------------------------------------
cmake_ok() {
  local v
  v="$("$1" --version 2>/dev/null | head -n1 | sed -n 's/^cmake version \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')"
  [[ -n "$v" ]] || return 1
  local major="${v%%.*}" minor="${v#*.}"
  (( major > 3 || (major == 3 && minor >= 25) ))
}
CMAKE="$(command -v cmake || true)"
if [[ -z "$CMAKE" ]] || ! cmake_ok "$CMAKE"; then
  if ! "$PY" -c 'import cmake' 2>/dev/null; then
    say "cmake >= 3.25 not found; pip install cmake"
    pip_install "cmake>=3.25"
  fi
  CMAKE="$("$PY" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))')"
  cmake_ok "$CMAKE" || die "no usable cmake >= 3.25 (tried $CMAKE)"
fi
NINJA="$(command -v ninja || command -v ninja-build || true)"
if [[ -z "$NINJA" ]]; then
  if ! "$PY" -c 'import ninja' 2>/dev/null; then
    say "ninja not found; pip install ninja"
    pip_install ninja
  fi
  NINJA="$("$PY" -c 'import ninja, os; print(os.path.join(ninja.BIN_DIR, "ninja"))')"
  [[ -x "$NINJA" ]] || die "ninja not usable (tried $NINJA)"
fi
say "cmake: $CMAKE ($("$CMAKE" --version | head -n1 | awk '{print $3}')), ninja: $NINJA"

# --- 3. CUTLASS ----------------------------------------------------------------
if [[ -n "${CUTLASS_DIR:-}" ]]; then
  say "CUTLASS: CUTLASS_DIR=$CUTLASS_DIR"
else
  have="$(dist_version nvidia-cutlass)"
  if [[ "$have" != "$CUTLASS_PIN" ]] || ! has_module cutlass_library; then
    say "CUTLASS: pip install nvidia-cutlass==$CUTLASS_PIN (headers only, --no-deps)${have:+ (found $have)}"
    pip_install --no-deps "nvidia-cutlass==$CUTLASS_PIN" \
      || die "could not install nvidia-cutlass==$CUTLASS_PIN. Offline? Put the wheel in a folder and set EPIFUSE_WHEELHOUSE=<folder> (or PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder>), or set CUTLASS_DIR=<CUTLASS 4.2.0 tree>."
  fi
  say "CUTLASS: nvidia-cutlass $(dist_version nvidia-cutlass) (pip)"
fi

# --- CUDA toolkit hint ----------------------------------------------------------
if [[ -z "${CUDA_HOME:-}" && -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null 2>&1 \
   && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDA_HOME=/usr/local/cuda
fi

# --- 4. configure + build ---------------------------------------------------------
need_configure=0
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  need_configure=1
  # a cache from another generator would make `-G Ninja` fail
  rm -rf "$BUILD_DIR/CMakeCache.txt" "$BUILD_DIR/CMakeFiles"
elif ! grep -qxF "Python3_EXECUTABLE:FILEPATH=$PY" "$BUILD_DIR/CMakeCache.txt" 2>/dev/null; then
  say "python changed since the last configure; wiping $BUILD_DIR"
  rm -rf "$BUILD_DIR"
  need_configure=1
elif [[ -n "${CUTLASS_DIR:-}" ]] && ! grep -qxF "CUTLASS_DIR:PATH=$CUTLASS_DIR" "$BUILD_DIR/CMakeCache.txt"; then
  need_configure=1
fi
cmake_args=(-DCMAKE_MAKE_PROGRAM="$NINJA" -DPython3_EXECUTABLE:FILEPATH="$PY")
if [[ -n "${CUTLASS_DIR:-}" ]]; then
  cmake_args+=(-DCUTLASS_DIR:PATH="$CUTLASS_DIR")
fi
if (( need_configure )); then
  say "configure: cmake -S . -B $BUILD_DIR -G Ninja"
  mkdir -p "$BUILD_DIR"
  "$CMAKE" -S . -B "$BUILD_DIR" -G Ninja "${cmake_args[@]}" > "$BUILD_DIR/configure.log" 2>&1 \
    || { grep -v '^--' "$BUILD_DIR/configure.log" | tail -n 40 >&2; die "cmake configure failed (full log: $BUILD_DIR/configure.log)"; }
  grep -E '^-- epifuse:' "$BUILD_DIR/configure.log" | sed 's/^-- /[epifuse]   /' || true
fi
say "build: cmake --build $BUILD_DIR -j $JOBS"
"$CMAKE" --build "$BUILD_DIR" -j "$JOBS"
LIB="$ROOT/python/epifuse/lib/libepifuse_ops.so"
[[ -f "$LIB" ]] || die "build finished but $LIB is missing"
[[ -f "${LIB%/*}/build_info.json" ]] || die "build finished but ${LIB%/*}/build_info.json is missing"

# --- 5. install the python package -------------------------------------------------
clean_py_build() { rm -rf "$ROOT/python/build" "$ROOT"/python/*.egg-info; }
# The package's metadata (SPDX license, setup.py's platform tag) needs setuptools >= 77.
if ! "$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
  say "setuptools >= 77 not found; pip install 'setuptools>=77'"
  pip_install "setuptools>=77" || say "could not install setuptools>=77 (the install below may fail)"
fi
clean_py_build
say "install: pip install --no-build-isolation --no-deps ./python"
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if "$PY" -m pip install --disable-pip-version-check --no-build-isolation --no-deps -q ./python; then
  rm -f "$site/epifuse-dev.pth" 2>/dev/null || true
else
  # e.g. a venv without setuptools and no network: make python/ importable instead
  say "pip install failed (setuptools>=61 missing?); linking $ROOT/python into $site via epifuse-dev.pth"
  printf '%s\n' "$ROOT/python" > "$site/epifuse-dev.pth"
fi
clean_py_build
say "done: $LIB"
