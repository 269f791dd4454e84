// Epilogue visitor trees of the sm80 GEMMs (CUTLASS 2.x API, mma.sync tensor cores), composed from
// CUTLASS's Sm80 visitor nodes. Same contract as the Hopper trees in epilogues.hpp:
//
//   PerColumnAffine   (eval mode)      D = a[n] * acc + c[n]
//   ColumnStatistics  (training mode)  D = z = D(acc),  colsum[n] += z,  colsumsq[n] += z^2 (fp64)
//                                      (the statistics of z as stored: epilogues.hpp says why)
//
// The 2.x trees end in an explicit store node (the 3.x collective stores the root's output itself).
// The column reductions sum each CTA's rows in registers and shared memory, then add the CTA's
// partial to colsum / colsumsq with an fp64 atomicAdd: the caller zeroes both vectors first.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/epilogue/threadblock/fusion/visitors.hpp"
#include "cutlass/functional.h"

#include "rounded_to.hpp"

namespace epifuse::sm80::evt {

using namespace cute;
using cutlass::FloatRoundStyle;
namespace tb = cutlass::epilogue::threadblock;

constexpr auto kRound = FloatRoundStyle::round_to_nearest;

using Accumulator = tb::VisitorAccFetch;

// Row-major [M, N] output with row stride ldo.
using StrideD = Stride<int64_t, _1, int64_t>;
template <class ThreadMap, class ElementD>
using StoreD = tb::VisitorAuxStore<ThreadMap, ElementD, kRound, StrideD>;

// Per-column vectors: broadcast down the rows ([N], unit stride).
using StrideColumn = Stride<_0, _1, int32_t>;

// A per-column fp32 vector (a or c), broadcast down the rows of the tile.
template <class ThreadMap>
using ColumnVector = tb::VisitorRowBroadcast<ThreadMap, float, StrideColumn>;

// ---- eval: D = a[n] * acc + c[n] ---------------------------------------------------------------
template <class ThreadMap, class ElementD>
using PerColumnAffine = tb::Sm80EVT<
    StoreD<ThreadMap, ElementD>,
    tb::Sm80EVT<tb::VisitorCompute<cutlass::homogeneous_multiply_add, ElementD, float, kRound>,
                ColumnVector<ThreadMap>,   // a[n]
                Accumulator,               // acc
                ColumnVector<ThreadMap>>>; // c[n]

// Arguments in the tree's order: {{a, acc, c, multiply_add}, store D}.
template <class Tree, class ElementD>
typename Tree::Arguments per_column_affine_args(const float* a, const float* c, ElementD* out,
                                                int64_t ldo, int N) {
  const StrideColumn column{_0{}, _1{}, int32_t(N)};
  return {{{a, 0.f, column}, {}, {c, 0.f, column}, {}}, {out, {ldo, _1{}, int64_t(0)}}};
}

// ---- training: D = z, per-column sum and sum of squares of z in fp64 -------------------------

// x * x per element of a fragment (fp64: the square of an fp32 value is exact in double).
template <class Fragment>
struct SquareOf {
  CUTLASS_HOST_DEVICE Fragment operator()(Fragment const& x) const {
    Fragment y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < Fragment::kElements; ++i) y[i] = x[i] * x[i];
    return y;
  }
};

// Keeps the first operand: the tree stores acc and drops the pass-through value of the
// sum-of-squares branch (a reduction node returns its input unchanged).
template <class Fragment>
struct FirstOperand {
  CUTLASS_HOST_DEVICE Fragment operator()(Fragment const& first, Fragment const&) const {
    return first;
  }
};

// z as stored: the accumulator rounded to ElementD (fp32 values).
template <class ElementD>
using Stored =
    tb::Sm80EVT<tb::VisitorCompute<RoundedTo<ElementD>::template Op, float, float, kRound>,
                Accumulator>;

// Per-column sum over the problem's rows in fp64 (the node widens its input to double itself);
// rows past M are skipped by the node's bounds check.
template <class ThreadMap>
using ColumnSum = tb::VisitorRowReduction<cutlass::plus, cutlass::atomic_add, ThreadMap, double,
                                          double, kRound, StrideColumn>;

template <class ThreadMap, class ElementD>
using ColumnStatistics = tb::Sm80EVT<
    StoreD<ThreadMap, ElementD>,
    tb::Sm80EVT<tb::VisitorCompute<FirstOperand, ElementD, float, kRound>,        // D = z
                tb::Sm80EVT<ColumnSum<ThreadMap>, Stored<ElementD>>,               // colsum
                tb::Sm80EVT<ColumnSum<ThreadMap>,                                  // colsumsq
                            tb::Sm80EVT<tb::VisitorCompute<SquareOf, double, double, kRound>,
                                        Stored<ElementD>>>>>;

// Arguments in the tree's order:
//   {{{{acc, round}, colsum}, {{{acc, round}, square}, colsumsq}, first-operand}, store D}.
template <class Tree, class ElementD>
typename Tree::Arguments column_statistics_args(double* colsum, double* colsumsq, ElementD* out,
                                                int64_t ldo, int N) {
  const StrideColumn column{_0{}, _1{}, int32_t(N)};
  return {{{{{}, {}}, {colsum, 0.0, column}}, {{{{}, {}}, {}}, {colsumsq, 0.0, column}}, {}},
          {out, {ldo, _1{}, int64_t(0)}}};
}

}  // namespace epifuse::sm80::evt
