#!/usr/bin/env python3
"""Generates the GEMM instantiations from one table (run by CMake at configure time).

Every CUTLASS GEMM epifuse compiles is one row of KERNELS below: architecture, input mode
(dtype and math), epilogue, schedule. From the table this writes, into --out-dir:

  sm90_gemm_<mode>_<epilogue>[_streamk|_small_m].cu, sm80_gemm_<mode>_<epilogue>.cu
      one explicit instantiation each (the slow part of the build, spread over translation units);
  sm90_gemm_kernels.hpp, sm80_gemm_kernels.hpp
      the tile configurations (TileConfig aliases), the `extern template` declarations that keep
      gemm_plan.cu and gemm_run.cu from instantiating a kernel themselves, and the kernel table
      the dispatcher plans with (kKernels: what each row is) and launches through (with_kernel:
      row -> types).

A new dtype, epilogue or schedule is one row in MODES / EPILOGUES / SCHEDULES and the rows of
KERNELS that use it (plus the C++ the new thing needs: a DType, an epilogue tree, a dispatch rule).
Files are rewritten only when their text changes, and files of rows that are gone are removed, so
a reconfigure recompiles what changed only. Like FlashAttention-3's hopper/generate_kernels.py.

  python3 generate_kernels.py --out-dir DIR      write the files, print the .cu paths
  python3 generate_kernels.py --list             print the .cu names only
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mode:
    """An input dtype and how it multiplies (kernels.h: DType, MathMode)."""
    name: str          # in file names: sm90_gemm_<name>_...
    alias: str         # TileConfig alias prefix: <alias>Wide, or the sm80 config itself
    element: str       # CUTLASS element type of x, w and the output
    dtype: str         # epifuse::DType
    math: str          # epifuse::MathMode
    k_tile: int        # K elements per stage: 128 bytes (the 128B-swizzle width)
    description: str   # for the generated files' first line


@dataclass(frozen=True)
class Epilogue:
    name: str          # in file names
    enum: str          # epifuse::Epilogue
    macro: str         # EPIFUSE_SM{80,90}_INSTANTIATE_<macro> / EXTERN_<macro>
    description: str


@dataclass(frozen=True)
class Sm90Schedule:
    """A Hopper tile configuration (sm90_gemm_configs.hpp says why each one exists)."""
    name: str          # sm90::Schedule enumerator k<name>, TileConfig alias suffix
    suffix: str        # file name suffix
    tile_n: int | None # None: the mode's wide tile
    cluster: str
    scheduler: str
    transposed: bool
    description: str


# ---- the table ---------------------------------------------------------------------------------

MODES = {
    "tf32": Mode("tf32", "Tf32", "float", "kFloat32", "kTF32", 32, "tf32"),
    "bf16": Mode("bf16", "Bf16", "cutlass::bfloat16_t", "kBFloat16", "kNative", 64, "bf16"),
    "fp16": Mode("fp16", "Fp16", "cutlass::half_t", "kFloat16", "kNative", 64, "fp16"),
    "3xtf32": Mode("3xtf32", "Split3x", "float", "kFloat32", "k3xTF32", 32,
                   "fp32-accurate 3x"),
}
# Hopper runs the fp32-accurate mode on operands split into row-scaled FP16 parts (split_fp16.cu):
# its K-tile is 64 halves (128 bytes), not the 32 floats of the mode's sm80 kernel.
SM90_SPLIT_K_TILE = 64

EPILOGUES = {
    "affine": Epilogue("affine", "kAffine", "AFFINE", "the per-column affine epilogue (eval mode)"),
    "colstats": Epilogue("colstats", "kColumnStats", "COLUMN_STATS",
                         "the column-statistics epilogue (training mode)"),
}

# Hopper: 128-row tiles; Wide* are 128x256 (3x: 128x128, its two accumulators take 64 + 64
# registers a thread), SmallM 128x64.
SM90_WIDE_TILE_N = {"tf32": 256, "bf16": 256, "fp16": 256, "3xtf32": 128}
SCHEDULES = {
    "Wide": Sm90Schedule("Wide", "", None, "Cluster2x1", "PersistentScheduler", False,
                         "data-parallel persistent"),
    "WideSK": Sm90Schedule("WideSK", "_streamk", None, "Cluster2x1", "StreamKScheduler", False,
                           "stream-K scheduled (grids of fewer tiles than SMs)"),
    "WideTransposed": Sm90Schedule("WideTransposed", "", None, "Cluster2x1", "PersistentScheduler",
                                   True, "transposed (z^T = w . x^T)"),
    "WideTransposedSK": Sm90Schedule("WideTransposedSK", "_streamk", None, "Cluster2x1",
                                     "StreamKScheduler", True,
                                     "transposed and stream-K (grids of fewer tiles than SMs)"),
    "SmallM": Sm90Schedule("SmallM", "_small_m", 64, "Cluster1x1", "StreamKScheduler", True,
                           "for small batches (transposed, stream-K; see small_batch in "
                           "gemm_plan.cu)"),
}

# sm80: one schedule (CUTLASS's stream-K swizzle), 128x128 CTA tiles of four 64x64 warps, three
# stages (sm80_gemm_configs.hpp says why).
SM80_CONFIGS = {
    # mode: (alias, instruction shape, math operator)
    "tf32": ("Tf32", "16, 8, 8", "cutlass::arch::OpMultiplyAdd"),
    "3xtf32": ("Fast3xTf32", "16, 8, 8", "cutlass::arch::OpMultiplyAddFastF32"),
    "bf16": ("Bf16", "16, 8, 16", "cutlass::arch::OpMultiplyAdd"),
    "fp16": ("Fp16", "16, 8, 16", "cutlass::arch::OpMultiplyAdd"),
}


@dataclass(frozen=True)
class Kernel:
    arch: int          # 90: Hopper TMA + wgmma (sm_90a), 80: mma.sync (sm_80 and later)
    mode: str
    epilogue: str
    schedule: str      # sm90: a SCHEDULES key; sm80: "StreamK"


# The instantiations: the training epilogue runs only on transposed Hopper tiles (its statistics
# are then per-row reductions of the tile, epilogues.hpp), the eval one on untransposed tiles and
# on SmallM.
KERNELS = [
    *(Kernel(90, mode, "affine", s) for mode in ("tf32", "bf16", "fp16", "3xtf32")
      for s in ("Wide", "WideSK", "SmallM")),
    *(Kernel(90, mode, "colstats", s) for mode in ("tf32", "bf16", "fp16", "3xtf32")
      for s in ("WideTransposed", "WideTransposedSK", "SmallM")),
    *(Kernel(80, mode, epi, "StreamK") for mode in ("tf32", "3xtf32", "bf16", "fp16")
      for epi in ("affine", "colstats")),
]


# ---- code --------------------------------------------------------------------------------------

HEADER = "// Generated by cpp/kernels/generate_kernels.py from its table; edit the table, not this file.\n"


def sm90_config_name(k: Kernel) -> str:
    return MODES[k.mode].alias + k.schedule


def sm90_config_type(mode: Mode, s: Sm90Schedule) -> str:
    tile_n = s.tile_n if s.tile_n is not None else SM90_WIDE_TILE_N[mode.name]
    split = mode.math == "k3xTF32"
    k_tile = SM90_SPLIT_K_TILE if split else mode.k_tile
    args = [mode.element, f"Shape<_128, _{tile_n}, _{k_tile}>", s.cluster, s.scheduler]
    if s.transposed or split:
        args.append("kTransposed" if s.transposed else "!kTransposed")
    if split:
        args.append("kSplit3x")
    return f"TileConfig<{', '.join(args)}>"


def sm90_tile(k: Kernel) -> tuple[int, int]:
    s = SCHEDULES[k.schedule]
    return 128, s.tile_n if s.tile_n is not None else SM90_WIDE_TILE_N[k.mode]


def cu_name(k: Kernel) -> str:
    if k.arch == 90:
        return f"sm90_gemm_{k.mode}_{k.epilogue}{SCHEDULES[k.schedule].suffix}.cu"
    return f"sm80_gemm_{k.mode}_{k.epilogue}.cu"


def config_name(k: Kernel) -> str:
    return sm90_config_name(k) if k.arch == 90 else SM80_CONFIGS[k.mode][0]


def instantiation_cu(k: Kernel) -> str:
    mode, epi = MODES[k.mode], EPILOGUES[k.epilogue]
    arch = f"sm{k.arch}"
    what = (f"the {mode.description} Hopper GEMM, {SCHEDULES[k.schedule].description},"
            if k.arch == 90 else f"the {mode.description} sm80 GEMM")
    return (f"{HEADER}// Instantiates {what} with {epi.description}.\n"
            f'#include "{arch}_gemm_kernels.hpp"\n\n'
            f"namespace epifuse::{arch} {{\n"
            f"EPIFUSE_{arch.upper()}_INSTANTIATE_{epi.macro}({config_name(k)})\n"
            f"}}  // namespace epifuse::{arch}\n")


def kernel_table(arch: int, rows: list[Kernel]) -> list[str]:
    """kKernels (what the dispatcher plans with) and with_kernel (a row's types, for the launch)."""
    out = ["// One row per instantiation; GemmPlan::kernel is an index into it.",
           "inline constexpr KernelInfo kKernels[] = {"]
    for k in rows:
        mode, epi = MODES[k.mode], EPILOGUES[k.epilogue]
        if arch == 90:
            tile_m, tile_n = sm90_tile(k)
            out.append(f"    {{DType::{mode.dtype}, MathMode::{mode.math}, Epilogue::{epi.enum}, "
                       f"Schedule::k{k.schedule}, {tile_m}, {tile_n}, \"sm90::{config_name(k)}\"}},")
        else:
            out.append(f"    {{DType::{mode.dtype}, MathMode::{mode.math}, Epilogue::{epi.enum}, "
                       f"\"sm80::{config_name(k)}\"}},")
    out += ["};", "inline constexpr int kKernelCount = int(sizeof(kKernels) / sizeof(kKernels[0]));",
            "",
            "// Calls fn(Config{}, EpilogueTag<e>{}) with the types of row `kernel` of kKernels.",
            "template <class Fn>",
            "void with_kernel(int kernel, Fn&& fn) {",
            "  switch (kernel) {"]
    for i, k in enumerate(rows):
        out.append(f"    case {i}: return fn({config_name(k)}{{}}, "
                   f"EpilogueTag<Epilogue::{EPILOGUES[k.epilogue].enum}>{{}});")
    out += ["    default: throw std::logic_error(\"epifuse: no such "
            f"sm{arch} kernel\");", "  }", "}"]
    return out


def sm90_header(rows: list[Kernel]) -> str:
    lines = [HEADER.rstrip("\n"),
             "// The Hopper GEMMs epifuse compiles: tile configurations, extern declarations of their",
             "// instantiations (sm90_gemm_*.cu), and the table the dispatcher picks from.",
             "#pragma once", "", "#include <stdexcept>", "", '#include "sm90_gemm_configs.hpp"', "",
             "namespace epifuse::sm90 {", ""]
    for mode in MODES.values():
        for s in SCHEDULES.values():
            if any(k.arch == 90 and k.mode == mode.name and k.schedule == s.name for k in rows):
                lines.append(f"using {mode.alias}{s.name} = {sm90_config_type(mode, s)};")
    lines.append("")
    for k in rows:
        lines.append(f"EPIFUSE_SM90_EXTERN_{EPILOGUES[k.epilogue].macro}({config_name(k)})")
    lines += ["", *kernel_table(90, rows), "", "}  // namespace epifuse::sm90", ""]
    return "\n".join(lines)


def sm80_header(rows: list[Kernel]) -> str:
    lines = [HEADER.rstrip("\n"),
             "// The sm80 GEMMs epifuse compiles: tile configurations, extern declarations of their",
             "// instantiations (sm80_gemm_*.cu), and the table the dispatcher picks from.",
             "#pragma once", "", "#include <stdexcept>", "", '#include "sm80_gemm_configs.hpp"', "",
             "namespace epifuse::sm80 {", ""]
    for name in dict.fromkeys(k.mode for k in rows):
        mode = MODES[name]
        alias, instruction, math = SM80_CONFIGS[name]
        k_tile = mode.k_tile
        lines.append(f"using {alias} = TileConfig<{mode.element}, GemmShape<128, 128, {k_tile}>, "
                     f"GemmShape<64, 64, {k_tile}>, GemmShape<{instruction}>, 3, {math}>;")
    lines.append("")
    for k in rows:
        lines.append(f"EPIFUSE_SM80_EXTERN_{EPILOGUES[k.epilogue].macro}({config_name(k)})")
    lines += ["", *kernel_table(80, rows), "", "}  // namespace epifuse::sm80", ""]
    return "\n".join(lines)


def generate() -> dict[str, str]:
    sm90 = [k for k in KERNELS if k.arch == 90]
    sm80 = [k for k in KERNELS if k.arch == 80]
    files = {cu_name(k): instantiation_cu(k) for k in KERNELS}
    if len(files) != len(KERNELS):
        sys.exit("generate_kernels.py: two rows of KERNELS name the same file")
    files["sm90_gemm_kernels.hpp"] = sm90_header(sm90)
    files["sm80_gemm_kernels.hpp"] = sm80_header(sm80)
    return files


def write(out_dir: Path, files: dict[str, str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = out_dir / name
        if not path.is_file() or path.read_text() != text:  # unchanged files keep their mtime
            path.write_text(text)
    for path in out_dir.iterdir():  # rows that are gone
        if path.is_file() and path.suffix in (".cu", ".hpp") and path.name not in files:
            path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, help="write the files here, print the .cu paths")
    parser.add_argument("--list", action="store_true", help="print the .cu file names only")
    args = parser.parse_args()
    files = generate()
    sources = [name for name in files if name.endswith(".cu")]
    if args.out_dir is not None:
        write(args.out_dir, files)
        print(";".join(str(args.out_dir / name) for name in sources))
    elif args.list:
        print("\n".join(sources))
    else:
        parser.error("give --out-dir or --list")


if __name__ == "__main__":
    main()
