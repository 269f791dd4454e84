"""The GEMM instantiation table (cpp/kernels/generate_kernels.py): what the dispatcher relies on.

gemm_plan.cu looks kernels up by (dtype, math, epilogue, schedule); a hole in the table would
be a logic_error at run time on the GPU, so the table is checked here, on any machine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "cpp" / "kernels" / "generate_kernels.py"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("generate_kernels", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_dispatch_choice_has_a_kernel(gen):
    rows = {(k.arch, k.mode, k.epilogue, k.schedule) for k in gen.KERNELS}
    for mode in ("tf32", "bf16", "fp16", "3xtf32"):
        # gemm_plan.cu, sm90_kernel: SmallM for both epilogues, Wide[SK] for the affine one,
        # WideTransposed[SK] for the statistics (sm80: one kernel per mode and epilogue).
        for schedule in ("Wide", "WideSK", "SmallM"):
            assert (90, mode, "affine", schedule) in rows
        for schedule in ("WideTransposed", "WideTransposedSK", "SmallM"):
            assert (90, mode, "colstats", schedule) in rows
        for epilogue in ("affine", "colstats"):
            assert (80, mode, epilogue, "StreamK") in rows


def test_statistics_run_on_transposed_tiles_only(gen):
    # ColumnStatsKernel static_asserts a transposed configuration (sm90_gemm.cuh).
    for k in gen.KERNELS:
        if k.arch == 90 and k.epilogue == "colstats":
            assert gen.SCHEDULES[k.schedule].transposed


def test_one_file_per_row_and_the_headers(gen, tmp_path):
    files = gen.generate()
    sources = [name for name in files if name.endswith(".cu")]
    assert len(sources) == len(gen.KERNELS) == len(set(sources))
    assert {"sm90_gemm_kernels.hpp", "sm80_gemm_kernels.hpp"} <= set(files)
    gen.write(tmp_path, files)
    stale = tmp_path / "sm90_gemm_gone_affine.cu"
    stale.write_text("// a row that was removed\n")
    gen.write(tmp_path, files)  # rewrites nothing, removes the stale file
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)


def test_instantiation_text(gen):
    files = gen.generate()
    text = files["sm90_gemm_3xtf32_colstats_small_m.cu"]
    assert '#include "sm90_gemm_kernels.hpp"' in text
    assert "EPIFUSE_SM90_INSTANTIATE_COLUMN_STATS(Split3xSmallM)" in text
    header = files["sm90_gemm_kernels.hpp"]
    assert ("using Split3xSmallM = TileConfig<float, Shape<_128, _64, _64>, Cluster1x1, "
            "StreamKScheduler, kTransposed, kSplit3x>;") in header
    assert "using Tf32Wide = TileConfig<float, Shape<_128, _256, _32>, Cluster2x1, " \
           "PersistentScheduler>;" in header
    assert "EPIFUSE_SM80_INSTANTIATE_AFFINE(Fast3xTf32)" in files["sm80_gemm_3xtf32_affine.cu"]
