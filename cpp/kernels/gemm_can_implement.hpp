// What the tensor-core GEMMs can implement (CUTLASS's can_implement, decided ahead of the launch):
// 16-byte aligned rows for TMA / cp.async, int32 extents, and which operands must first be copied
// into K-major rows. The plan (gemm_plan.cu: choose_kind, gemm_plan) and the launch's
// check (gemm_run.cu) share these rules, so they cannot disagree.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda_utils.cuh"
#include "epifuse/kernels.h"

namespace epifuse::dispatch {

// What both tensor-core paths need: 16-byte aligned rows for TMA / cp.async, and int32 extents.
// The epilogue's side: output rows and per-column vectors.
inline bool output_aligned(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops) {
  const int64_t align = p.dtype == DType::kFloat32 ? 4 : 8;  // elements per 16 bytes
  if (p.N % align || p.ldo % align || !is_aligned16(p.out)) return false;
  if (p.M > INT_MAX || p.N > INT_MAX) return false;
  // The epilogue's per-column vectors are read / written as 16-byte vectors.
  if (e == Epilogue::kAffine && !(is_aligned16(ops.a) && is_aligned16(ops.c))) return false;
  if (e == Epilogue::kColumnStats && !(is_aligned16(ops.colsum) && is_aligned16(ops.colsumsq)))
    return false;
  return true;
}

// Whether an operand's rows are what the tensor-core kernels read: unit column stride, 16-byte
// aligned rows.
inline bool rows_aligned(const void* ptr, int64_t ld, int64_t col_stride, int64_t align) {
  return col_stride == 1 && ld % align == 0 && is_aligned16(ptr);
}

// The input side. An operand the plan copies (`copies`) is read from the copy, a fresh row-major
// allocation (row stride K, 16-byte aligned: kernels.h, GemmPlan::copies), so only K counts for it.
inline bool vector_aligned(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops,
                           KMajorCopies copies) {
  const int64_t align = p.dtype == DType::kFloat32 ? 4 : 8;  // elements per 16 bytes
  if (p.K % align || p.K > INT_MAX) return false;
  if (!copies.x && !rows_aligned(p.x, p.ldx, p.x_col_stride, align)) return false;
  if (!copies.w && !rows_aligned(p.w, p.ldw, p.w_col_stride, align)) return false;
  return output_aligned(p, e, ops);
}

// Operands without rows of unit column stride (e.g. transposed views), which every plan but the
// split one reads only through a K-major copy.
inline KMajorCopies unit_stride_copies(const GemmProblem& p) {
  const int64_t k = std::max<int64_t>(p.K, 1);
  KMajorCopies copies;
  copies.x = !(p.x_col_stride == 1 && p.ldx >= k);
  copies.w = !(p.w_col_stride == 1 && p.ldw >= k);
  return copies;
}

}  // namespace epifuse::dispatch
