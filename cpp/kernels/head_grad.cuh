// The pieces the head's backward passes share: how a pass reads a row's elements, dv and z, the
// activation's factor of dv, and the compile-time dispatch on the operands' dtypes, vector width
// and softmax. The passes themselves are one file each (below).
//
// Backward of a head: from g = grad of the output to dz = grad of z = x . W^T (the backward's
// GEMMs, dX = dz . W and dW = dz^T . x, run by the backward_matmul op), plus the gradients of
// bias, BatchNorm's gamma / beta and the scale. python/epifuse/fold.py ("backward") is the
// reference for the math; tests hold these kernels to it.
//
//   softmax_grad_rowdot     (head_grad_rowdot.cu; softmax heads) one pass over g, out:
//                           r[m] = sum_n g * out, so that dv = out * (g - r[m]) is known element
//                           by element afterwards. (With an activation, dv is also multiplied by
//                           act'(h), h = a * z + c recomputed from z and the forward's fold:
//                           nothing more is kept.)
//   head_grad_sums          (head_grad_sums.cu) one pass over g, out, z: per-column S1 = sum dv,
//                           S3 = sum dv * z in fp64.
//   head_grad_coefficients  (head_grad_coefficients.cu) per column, fp64: dz = A * dv + B * z + C,
//                           parameter gradients.
//   head_grad_z             (head_grad_z.cu) one pass over g, out, z writing dz.
// The row term needs whole rows and the column sums whole columns, so they are separate passes
// (a block owning both a row band and all its columns would hold N fp64 partial pairs).
//
// Determinism: the row term is reduced by a fixed shuffle tree and warp order; each column's sums
// by one block per split of the rows in a fixed order (as column_stats.cu), then the splits by
// sum_tile_partials (a fixed order too); one-element scale gradients by fixed trees
// over each column block, then over the blocks in block order (one atomic ticket only says which
// block is last, not what is summed).
#pragma once

#include <type_traits>

#include "activation.cuh"
#include "cuda_utils.cuh"

namespace epifuse::head_grad {

// Under autocast g and out are the head's fp32 output (and its gradient) while z is the GEMM's 16-bit
// output: the kernels take G (g, out) and Z (z, dz), and a vector is the narrower type's 16 bytes.

// A row's kVec elements as loaded: whole 16-byte vectors, or one element when kVec == 1.
template <class T, int kVec>
struct RowVec {
  Vec<T, kVec> v;
  __device__ __forceinline__ void load(const T* p) { v = *reinterpret_cast<const Vec<T, kVec>*>(p); }
  __device__ __forceinline__ float operator[](int j) const { return to_float(v.v[j]); }
};
template <class T>
struct RowVec<T, 1> {
  T v;
  __device__ __forceinline__ void load(const T* p) { v = *p; }
  __device__ __forceinline__ float operator[](int) const { return to_float(v); }
};

// Loads kVec consecutive elements (one 16-byte vector, or one element when kVec == 1) as fp32.
template <class T, int kVec>
__device__ __forceinline__ void load_floats(const T* p, float (&v)[kVec]) {
  static_assert(kVec == 1 || kVec % Vec16<T>::kSize == 0, "vector loads are whole 16 bytes");
  RowVec<T, kVec> r;
  r.load(p);
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = r[j];
}

// dv (the gradient at the softmax's input, or g itself) and z at (row, col .. col + kVec).
template <class G, class Z, int kVec, bool kSoftmax>
__device__ __forceinline__ void load_dv_z(const GradOperands& o, int64_t row, int64_t col,
                                          float (&dv)[kVec], float (&z)[kVec]) {
  load_floats<G, kVec>(static_cast<const G*>(o.g) + row * o.ld_g + col, dv);
  if constexpr (kSoftmax) {
    float out[kVec];
    load_floats<G, kVec>(static_cast<const G*>(o.out) + row * o.ld_out + col, out);
    const float r = __ldg(o.rowdot + row);
#pragma unroll
    for (int j = 0; j < kVec; ++j) dv[j] = out[j] * (dv[j] - r);
  }
  load_floats<Z, kVec>(static_cast<const Z*>(o.z) + row * o.ld_z + col, z);
}

// The activation's factor of dv, act'(a[n] * z + c[n]), for one thread's kVec columns (a and c
// loaded once), its kind a compile-time constant (dispatch_activation: no switch per element).
// Without an activation nothing is loaded and dv passes through.
template <int kVec, ActivationKind kKind>
struct ActivationGrad {
  float negative_slope;
  float a[kVec] = {}, c[kVec] = {};
  __device__ __forceinline__ ActivationGrad(const GradOperands& o, int64_t col)
      : negative_slope(o.act.negative_slope) {
    if constexpr (kKind != ActivationKind::kNone) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        a[j] = __ldg(o.a + col + j);
        c[j] = __ldg(o.c + col + j);
      }
    }
  }
  __device__ __forceinline__ float operator()(float dv, float z, int j) const {
    if constexpr (kKind == ActivationKind::kNone) {
      return dv;
    } else {
      return dv * activation_grad(Activation{kKind, negative_slope}, fmaf(a[j], z, c[j]));
    }
  }
};

// Whether every operand allows vectors of kVec elements (whole 16-byte accesses) along its rows.
template <int kVec>
bool vectorizable(const GradOperands& o) {
  auto ok = [&](const void* p, int64_t ld) { return p == nullptr || (is_aligned16(p) && ld % kVec == 0); };
  return o.N % kVec == 0 && ok(o.g, o.ld_g) && ok(o.out, o.ld_out) && ok(o.z, o.ld_z);
}

// Calls fn(G{}, Z{}, vector width, softmax) with the compile-time choices for these operands.
template <class Fn>
void dispatch_grad(const GradOperands& o, bool extra_vectorizable, Fn&& fn) {
  dispatch_in_out(o.z_dtype, o.dtype, [&](auto z_tag, auto g_tag) {
    using G = decltype(g_tag);
    using Z = decltype(z_tag);
    constexpr int kVec = kNarrowVec<G, Z>;
    const bool vec = extra_vectorizable && vectorizable<kVec>(o);
    auto by_softmax = [&](auto width) {
      if (o.out != nullptr) {
        fn(g_tag, z_tag, width, std::true_type{});
      } else {
        fn(g_tag, z_tag, width, std::false_type{});
      }
    };
    if (vec) {
      by_softmax(std::integral_constant<int, kVec>{});
    } else {
      by_softmax(std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace epifuse::head_grad
