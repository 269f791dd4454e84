// Epilogue visitor trees (EVTs) of the epifuse GEMMs, composed from CUTLASS's Sm90 visitor nodes.
//
// The GEMM computes the fp32 accumulator acc[m, n] = sum_k x[m, k] * w[n, k]. Everything the head
// does after the Linear layer is per column, so it is one of two trees over acc:
//
//   PerColumnAffine             (eval mode)      D = act(a[n] * acc + c[n])
//                               (PerColumnAffineTransposed: the same for z^T = w . x^T)
//   ColumnStatisticsTransposed  (training mode)  D' = z' = D(acc'), colsum[n] += z', colsumsq[n] += z'^2
//                               for z^T = w . x^T, the form every Hopper training GEMM takes
//
// Training needs the batch statistics before the affine can be folded, so it stores z and a
// later bandwidth-bound pass applies (a, c). The statistics are those of z as stored (acc rounded
// to D's type), the values the pass normalizes, as BatchNorm's statistics are those of its input:
// with a 16-bit z, statistics of the unrounded acc left each normalized column off-centre by its
// rounding's mean, a bias that sums coherently in reductions over the batch (problem 84's
// one-element scale gradient under bf16 autocast: up to 4x eager's error against float64, against
// 0.45x with the stored z's statistics, a float64 emulation over 40 seeds). For an fp32 z, z = acc.
// The statistics are reduced in fp64: when a column's mean dwarfs its spread (|mean|/std >= 1e3),
// var = E[z^2] - E[z]^2 cancels ~6 digits, which fp32 sums cannot afford but fp64 sums of the
// (exact) fp32 values can.
//
// Each tree reads the product through its `Acc` leaf: the accumulator itself (Sm90AccFetch), or,
// for the 3x GEMM's row-scaled FP16 operands (split_fp16.cu), ScaledAccFetch, the accumulator
// scaled back by its rows' and columns' exponents.
#pragma once

#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/functional.h"

#include <type_traits>

#include "activation.cuh"
#include "rounded_to.hpp"

namespace epifuse::evt {

using namespace cute;
using cutlass::FloatRoundStyle;
namespace fusion = cutlass::epilogue::fusion;

constexpr auto kRound = FloatRoundStyle::round_to_nearest;

// A per-column fp32 vector (a or c), broadcast down the rows of the tile.
template <class CtaTileShapeMNK>
using ColumnVector = fusion::Sm90RowBroadcast<0, CtaTileShapeMNK, float, float>;

// ---- the product of row-scaled operands: acc[m, n] * 2^(e_a[m] + e_b[n]) -------------------------
// split_fp16 stores each row of the kernel's A (its M extent) and B (its N extent) scaled by
// 2^-e; the accumulator is the product of the scaled rows, and ldexp puts the scale back exactly
// (the sum of exponents, one rounding-free step, where two multiplies by 2^e could overflow or
// underflow between them).
template <class T>
struct ScaleByExponents {
  CUTLASS_DEVICE T operator()(T const& e_a, T const& acc, T const& e_b) const {
    return ldexpf(acc, int(e_a + e_b));
  }
};

template <class T, int N>
struct ScaleByExponents<cutlass::Array<T, N>> {
  CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& e_a,
                                                 cutlass::Array<T, N> const& acc,
                                                 cutlass::Array<T, N> const& e_b) const {
    cutlass::Array<T, N> d;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) d[i] = ldexpf(acc[i], int(e_a[i] + e_b[i]));
    return d;
  }
};

template <class CtaTileShapeMNK>
using ScaledAccFetch = fusion::Sm90EVT<
    fusion::Sm90Compute<ScaleByExponents, float, float, kRound>,
    fusion::Sm90ColBroadcast<0, CtaTileShapeMNK, float, float>,  // e_a[m], m = the kernel's row
    fusion::Sm90AccFetch,
    fusion::Sm90RowBroadcast<0, CtaTileShapeMNK, float, float>>; // e_b[n], n = the kernel's column

// The Acc leaf's arguments: none for the accumulator itself; the exponents of the kernel's A rows
// and B rows for ScaledAccFetch.
template <class Acc>
typename Acc::Arguments acc_args(const float* e_a, const float* e_b) {
  if constexpr (std::is_same_v<Acc, fusion::Sm90AccFetch>) {
    (void)e_a, (void)e_b;
    return {};
  } else {
    return {{e_a, 0.f}, {}, {e_b, 0.f}, {}};
  }
}

// ---- eval: D = act(a[n] * acc + c[n]) ----------------------------------------------------------

// act(a * acc + c) per element: the folded BatchNorm (and scale) and the head's activation in one
// compute node. The activation is a runtime argument (Sm90Compute passes a functor's Arguments to
// it), chosen once per fragment (activation.cuh, activate_fragment), so one kernel per tile
// configuration serves every activation; with none it is the multiply-add alone. The backward's
// dX and dW GEMMs run this tree too, with a = 1, c = 0 and no activation.
template <class T>
struct AffineActivation {
  using Arguments = Activation;
  CUTLASS_DEVICE T operator()(T const& a, T const& acc, T const& c, Arguments const& act) const {
    return activate(act, a * acc + c);
  }
};

template <class T, int N>
struct AffineActivation<cutlass::Array<T, N>> {
  using Arguments = Activation;
  CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& a,
                                                 cutlass::Array<T, N> const& acc,
                                                 cutlass::Array<T, N> const& c,
                                                 Arguments const& act) const {
    cutlass::Array<T, N> d;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) d[i] = a[i] * acc[i] + c[i];
    activate_fragment<cutlass::Array<T, N>, N>(act, d);  // one branch per fragment
    return d;
  }
};

template <class CtaTileShapeMNK, class ElementD, class Acc = fusion::Sm90AccFetch>
using PerColumnAffine =
    fusion::Sm90EVT<fusion::Sm90Compute<AffineActivation, ElementD, float, kRound>,
                    ColumnVector<CtaTileShapeMNK>,  // a[n]
                    Acc,                            // acc
                    ColumnVector<CtaTileShapeMNK>>; // c[n]

// Arguments in the tree's order: {a, acc, c, activation}; the same for the transposed tree.
// A null a or c broadcasts its default instead (a = 1, c = 0): with both null and no activation
// the tree stores the plain product (the backward's dX and dW GEMMs). acc: acc_args.
template <class Fusion, class AccArguments>
typename Fusion::Arguments per_column_affine_args(const float* a, const float* c, Activation act,
                                                  AccArguments acc) {
  return {{a, 1.f}, acc, {c, 0.f}, act};
}

// ---- eval, transposed GEMM: D'[n, m] = act(a[n] * acc'[n, m] + c[n]) --------------------------
// For small batches the GEMM runs as z^T = w . x^T (see sm90_gemm.cuh, kTransposed): the head's
// columns are then the rows of the kernel's tile, so a and c are broadcast along its columns.
template <class CtaTileShapeMNK>
using RowVector = fusion::Sm90ColBroadcast<0, CtaTileShapeMNK, float, float>;

template <class CtaTileShapeMNK, class ElementD, class Acc = fusion::Sm90AccFetch>
using PerColumnAffineTransposed =
    fusion::Sm90EVT<fusion::Sm90Compute<AffineActivation, ElementD, float, kRound>,
                    RowVector<CtaTileShapeMNK>,  // a[n], n = the kernel's row
                    Acc,                         // acc' = acc^T
                    RowVector<CtaTileShapeMNK>>; // c[n]

// ---- training: building blocks of the statistics tree ------------------------------------------

// Register-level step of the sum of squares: r += x * x (the shuffle/smem/gmem steps are plain sums).
template <class T>
struct AccumulateSquare {
  CUTLASS_HOST_DEVICE T operator()(T const& running, T const& x) const { return running + x * x; }
};

// Keeps the first operand: the root of the statistics tree stores acc and discards the pass-through
// value of the sum-of-squares branch (each reduction node returns its input unchanged).
template <class T>
struct FirstOperand {
  CUTLASS_HOST_DEVICE T operator()(T const& first, T const&) const { return first; }
};

// z as stored (the accumulator rounded to ElementD), widened to fp64 (exact): the input of the
// column reductions.
template <class ElementD, class Acc>
using StoredAsDouble =
    fusion::Sm90EVT<fusion::Sm90Compute<RoundedTo<ElementD>::template Op, double, float, kRound>,
                    Acc>;

// ---- training, transposed GEMM: D'[n, m] = z'[n, m], per-row (= per-column of z) fp64 sums ------
// The head's columns are the rows of the transposed kernel's tile, so the statistics reduce along
// the tile's N extent. In the wgmma accumulator layout a thread holds 2 rows of each 16-row slab,
// and the 4 lanes that share a row combine with 2 shuffles: the running fp64 sums take 8 registers
// per thread whatever the tile width (the untransposed tree keeps one pair per column it touches,
// 64 columns of a 256-wide tile), so the 128x256 tiles of the affine kernel can carry them.
// Each tile stores its partial sums (FinalReduction = false: a [tiles along N][rows rounded up to
// the tile] fp64 buffer); sum_tile_partials (tile_partials.cu) adds them after the GEMM, in a fixed
// order: deterministic, no atomics on the sums.
// VisitCheckOOB = false: batch columns past M are zero-filled by TMA, so they add 0 to both sums and
// need no per-element bounds check (which costs registers and instructions in the hot epilogue loop).
template <template <class> class RegReduce, class CtaTileShapeMNK>
using RowReduction =
    fusion::Sm90ColReduction<RegReduce, cutlass::plus, cutlass::plus, 0, CtaTileShapeMNK,
                             double, double, kRound, Stride<_1, _0, _0>, /*Alignment=*/2,
                             /*EnableNullptr=*/false, /*FinalReduction=*/false,
                             /*VisitCheckOOB=*/false>;

// (With ScaledAccFetch, each branch scales its own copy of the accumulator: two ldexps per element
// in an epilogue that the 3x GEMM's mainloop hides.)
template <class CtaTileShapeMNK, class ElementD, class Acc = fusion::Sm90AccFetch>
using ColumnStatisticsTransposed = fusion::Sm90EVT<
    fusion::Sm90Compute<FirstOperand, ElementD, float, kRound>,                             // D' = z'
    fusion::Sm90EVT<RowReduction<cutlass::plus, CtaTileShapeMNK>,
                    StoredAsDouble<ElementD, Acc>>,                                       // colsum
    fusion::Sm90EVT<RowReduction<AccumulateSquare, CtaTileShapeMNK>,
                    StoredAsDouble<ElementD, Acc>>>;                                      // colsumsq

// Arguments in the tree's order: {{{acc, widen}, sums}, {{acc, widen}, sums of squares}, first
// operand}; the pointers are the per-tile partial buffers (see RowReduction). acc: acc_args.
template <class Fusion, class AccArguments>
typename Fusion::Arguments column_statistics_args(double* partial_sum, double* partial_sumsq,
                                                  AccArguments acc) {
  return {{{acc, {}}, {partial_sum, 0.0}}, {{acc, {}}, {partial_sumsq, 0.0}}, {}};
}

}  // namespace epifuse::evt
