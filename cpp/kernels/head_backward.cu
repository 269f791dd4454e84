// Backward of a head: from g = grad of the output to dz = grad of z = x . W^T (the backward's
// GEMMs, dX = dz . W and dW = dz^T . x, run in cuBLAS), plus the gradients of bias, BatchNorm's
// gamma / beta and the scale. python/epifuse/fold.py ("backward") is the reference for the math;
// tests hold these kernels to it.
//
//   softmax_grad_rowdot   (softmax heads) one pass over g, out: r[m] = sum_n g * out, so that
//                         dv = out * (g - r[m]) is known element by element afterwards.
//                         (With an activation, dv is also multiplied by act'(h), h = a * z + c
//                         recomputed from z and the forward's fold: nothing more is kept.)
//   head_grad_sums        one pass over g, out, z: per-column S1 = sum dv, S3 = sum dv * z in fp64.
//   head_grad_coefficients  per column, fp64: dz = A * dv + B * z + C, parameter gradients.
//   head_grad_z           one pass over g, out, z writing dz.
// The row term needs whole rows and the column sums whole columns, so they are separate passes
// (a block owning both a row band and all its columns would hold N fp64 partial pairs).
//
// Determinism: the row term is reduced by a fixed shuffle tree and warp order; each column's sums
// by one block per split of the rows in a fixed order (as column_stats.cu), then the splits by
// sum_tile_partials (a fixed order too); one-element scale gradients by fixed trees
// over each column block, then over the blocks in block order (one atomic ticket only says which
// block is last, not what is summed).
#include <algorithm>
#include <climits>
#include <stdexcept>

#include "activation.cuh"
#include "cuda_utils.cuh"
#include "tile_partials.hpp"

namespace epifuse {
namespace {

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

// ---- row term of the softmax backward ----------------------------------------------------------
// kLanes threads per row (32..256, by row length), 256-thread blocks; a row's lanes reduce by
// shuffles, then its warps through shared memory in warp order.
constexpr int kRowdotThreads = 256;

template <class T, int kVec, int kLanes>
__global__ void __launch_bounds__(kRowdotThreads)
softmax_grad_rowdot_kernel(GradOperands o, float* __restrict__ rowdot) {
  constexpr int kRows = kRowdotThreads / kLanes;
  constexpr int kWarpsPerRow = kLanes / 32;
  __shared__ float part[kRowdotThreads / 32];
  const int lane = threadIdx.x % kLanes;
  const int64_t row = int64_t(blockIdx.x) * kRows + threadIdx.x / kLanes;
  float acc = 0.f;
  if (row < o.M) {
    const T* g = static_cast<const T*>(o.g) + row * o.ld_g;
    const T* out = static_cast<const T*>(o.out) + row * o.ld_out;
    for (int64_t col = int64_t(lane) * kVec; col < o.N; col += int64_t(kLanes) * kVec) {
      float gv[kVec], ov[kVec];
      load_floats<T, kVec>(g + col, gv);
      load_floats<T, kVec>(out + col, ov);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc = fmaf(gv[j], ov[j], acc);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if constexpr (kWarpsPerRow == 1) {
    if (lane == 0 && row < o.M) rowdot[row] = acc;
  } else {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) part[warp] = acc;
    __syncthreads();
    if (lane == 0 && row < o.M) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kWarpsPerRow; ++w) s += part[warp + w];
      rowdot[row] = s;
    }
  }
}

template <class T, int kVec>
void launch_rowdot(const GradOperands& o, float* rowdot, cudaStream_t stream) {
  const int64_t vecs = (o.N + kVec - 1) / kVec;  // kVec > 1 implies N % kVec == 0
  auto run = [&](auto lanes) {
    constexpr int kLanes = decltype(lanes)::value;
    const int64_t blocks = (o.M + kRowdotThreads / kLanes - 1) / (kRowdotThreads / kLanes);
    softmax_grad_rowdot_kernel<T, kVec, kLanes>
        <<<unsigned(blocks), kRowdotThreads, 0, stream>>>(o, rowdot);
  };
  // About 4..16 loads per lane and tensor: enough in flight without idling lanes on short rows.
  if (vecs <= 128) {
    run(std::integral_constant<int, 32>{});
  } else if (vecs <= 512) {
    run(std::integral_constant<int, 64>{});
  } else if (vecs <= 2048) {
    run(std::integral_constant<int, 128>{});
  } else {
    run(std::integral_constant<int, 256>{});
  }
}

// ---- column sums ---------------------------------------------------------------------------------
// A block owns a band of 32 columns and strides over every row, 16-byte vectors (kVec elements) per
// thread and row; lanes holding the same columns add by shuffles, the warps through shared memory in
// warp order. Each thread loads kRowsInFlight rows (kept packed) before the first use, sums their dv
// and dv * z in fp32, then adds those two partials to its fp64 sums: one fp32 -> fp64 conversion per
// element and sum every kRowsInFlight rows instead of every row. Converting every element (and
// spilling at 1024 threads, which ptxas caps at 64 registers) held problem 39's sums (bf16,
// 16384 x 4096) at 108.5 us, 2.47 TB/s; this layout runs them in 96.1 us, 2.79 TB/s, and problem
// 84's (softmax, 1024 x 8192) in 22.3 us against 25.0 (H100, each kernel alone on inputs that miss L2).
// The fp32 partials cover kRowsInFlight terms: their rounding (2^-24 relative per add) is far below
// the fp32 accumulation over all rows that PyTorch's BatchNorm backward does.
//
// A band is 8 lanes' vectors wide (fp32: 32 columns, 16-bit: 64), so that each row's piece of a
// 16-byte-vector operand is a whole 128-byte line (32 columns of bf16 read half lines). Alone this
// measured no change at 4096 x 4096 bf16 (41 us, H200), where the activation's per-element switch
// bounded the loop (dispatch_activation fixed that: 22 us). Unvectorized operands (kVec 1) keep
// 32 lanes on 32 columns.
template <int kVec>
constexpr int kSumsCols = kVec == 1 ? 32 : 8 * kVec;

template <class G, class Z, int kVec, bool kSoftmax, int kThreads, int kRowsInFlight>
__global__ void __launch_bounds__(kThreads)
head_grad_sums_kernel(GradOperands o, int64_t rows_per_split, double* __restrict__ sums,
                      double* __restrict__ row_count) {
  constexpr int kCols = kSumsCols<kVec>;
  constexpr int kLanesPerRow = kCols / kVec;
  constexpr int kRowGroups = kThreads / kLanesPerRow;
  constexpr int kWarps = kThreads / 32;
  __shared__ double part_s1[kWarps][kCols];
  __shared__ double part_s3[kWarps][kCols];

  const int lane = threadIdx.x % 32;
  const int sub = threadIdx.x % kLanesPerRow;
  const int group = threadIdx.x / kLanesPerRow;
  const int64_t col0 = int64_t(blockIdx.x) * kCols;
  const int64_t col = col0 + int64_t(sub) * kVec;
  double s1[kVec] = {}, s3[kVec] = {};
  if (col < o.N) dispatch_activation(o.act.kind, [&](auto kind) {
    const ActivationGrad<kVec, decltype(kind)::value> act_grad(o, col);
    const G* g = static_cast<const G*>(o.g) + col;
    const Z* z = static_cast<const Z*>(o.z) + col;
    [[maybe_unused]] const G* out = kSoftmax ? static_cast<const G*>(o.out) + col : nullptr;
    // This block's rows: split blockIdx.y of the column band (one split: all of them).
    const int64_t row_begin = int64_t(blockIdx.y) * rows_per_split;
    const int64_t row_end = std::min(o.M, row_begin + rows_per_split);
    int64_t row = row_begin + group;
    for (; row + (kRowsInFlight - 1) * kRowGroups < row_end; row += kRowsInFlight * kRowGroups) {
      RowVec<G, kVec> gv[kRowsInFlight];
      [[maybe_unused]] RowVec<G, kVec> ov[kSoftmax ? kRowsInFlight : 1];
      RowVec<Z, kVec> zv[kRowsInFlight];
      [[maybe_unused]] float r[kSoftmax ? kRowsInFlight : 1];
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) {
        const int64_t m = row + i * kRowGroups;
        gv[i].load(g + m * o.ld_g);
        zv[i].load(z + m * o.ld_z);
        if constexpr (kSoftmax) {
          ov[i].load(out + m * o.ld_out);
          r[i] = __ldg(o.rowdot + m);
        }
      }
      float p1[kVec] = {}, p3[kVec] = {};
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i)
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          float dv = gv[i][e];
          if constexpr (kSoftmax) dv = ov[i][e] * (dv - r[i]);
          dv = act_grad(dv, zv[i][e], e);
          p1[e] += dv;
          p3[e] = fmaf(dv, zv[i][e], p3[e]);
        }
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        s1[e] += double(p1[e]);
        s3[e] += double(p3[e]);
      }
    }
    for (; row < row_end; row += kRowGroups) {
      float dv[kVec], zf[kVec];
      load_dv_z<G, Z, kVec, kSoftmax>(o, row, col, dv, zf);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        dv[e] = act_grad(dv[e], zf[e], e);
        s1[e] += dv[e];
        s3[e] = fma(double(dv[e]), double(zf[e]), s3[e]);  // exact product of two fp32 values
      }
    }
  });
#pragma unroll
  for (int offset = kLanesPerRow; offset < 32; offset *= 2)
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      s1[e] += __shfl_xor_sync(0xffffffffu, s1[e], offset);
      s3[e] += __shfl_xor_sync(0xffffffffu, s3[e], offset);
    }
  if (lane < kLanesPerRow) {
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      part_s1[warp][lane * kVec + e] = s1[e];
      part_s3[warp][lane * kVec + e] = s3[e];
    }
  }
  __syncthreads();
  // One split: the sums themselves; several: split y's partials at sums + 2N * y (the scratch),
  // which sum_tile_partials adds (S1 and S3 as its two statistics, the splits as its tiles).
  double* out = sums + 2 * o.N * int64_t(blockIdx.y);
  if (threadIdx.x < kCols && col0 + threadIdx.x < o.N) {
    double a = 0.0, b = 0.0;
    for (int w = 0; w < kWarps; ++w) {
      a += part_s1[w][threadIdx.x];
      b += part_s3[w][threadIdx.x];
    }
    out[col0 + threadIdx.x] = a;
    out[o.N + col0 + threadIdx.x] = b;
  }
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *row_count = double(o.M);
}

// Splits of the rows of each column band, for narrow problems whose bands leave SMs idle: as many
// as keep the blocks within one wave of one 512-thread block per SM, each split at least
// kMinRowsPerSplit rows. A projection's 4096 x 256 last layer ran on 8 blocks in 14.1 us (bf16,
// H200, inside a training step); in 4 splits 7.9 us plus 1.2 us for the splits' sum. Splitting
// further, into the 256-thread form's two blocks per SM, measured 2.2x slower for 4096 x 4096 bf16
// (89 against 41 us) and no faster in fp32: wider problems keep one split.
constexpr int64_t kMinRowsPerSplit = 1024;

int sums_row_splits(const GradOperands& o, int cols) {
  const int64_t bands = (o.N + cols - 1) / cols;
  const int64_t want = int64_t(sm_count(current_device())) / bands;
  const int64_t most = std::max<int64_t>(o.M / kMinRowsPerSplit, 1);
  return int(std::max<int64_t>(1, std::min({want, most, int64_t(65535)})));
}

template <class G, class Z, int kVec, bool kSoftmax>
void launch_sums(const GradOperands& o, double* sums, double* partials, int splits,
                 cudaStream_t stream) {
  constexpr int kCols = kSumsCols<kVec>;
  const unsigned bands = unsigned((o.N + kCols - 1) / kCols);
  const int64_t rows_per_split = (o.M + splits - 1) / splits;
  double* out = splits > 1 ? partials : sums;
  const dim3 grid(bands, unsigned(splits));
  // ~100 registers a thread: one 512-thread block or two 256-thread blocks fit an SM. Bands that fit
  // one per SM get 512 threads (problem 39: 128 bands, 96.1 us against 112.0 with 256); more blocks
  // get 256 threads, two per SM, so that up to twice the SMs' blocks run in one wave (problem 84:
  // 256 bands, 22.3 us against 23.8 with 512). Either way 2048 row vectors per block in flight.
  if (uint64_t(bands) * unsigned(splits) > unsigned(sm_count(current_device()))) {
    head_grad_sums_kernel<G, Z, kVec, kSoftmax, 256, 8>
        <<<grid, 256, 0, stream>>>(o, rows_per_split, out, sums + 2 * o.N);
  } else {
    head_grad_sums_kernel<G, Z, kVec, kSoftmax, 512, 4>
        <<<grid, 512, 0, stream>>>(o, rows_per_split, out, sums + 2 * o.N);
  }
  if (splits > 1) {
    // Split y's [S1 | S3] at partials + 2N * y: S1 and S3 as the two statistics of `splits` tiles.
    sum_tile_partials(o.N, splits, 2 * o.N, partials, partials + o.N, sums, sums + o.N, stream);
  }
}

// ---- per-column coefficients -----------------------------------------------------------------
// One thread per column (a few dozen fp64 operations, a division and a square root). A one-element
// scale's gradient is the sum over the columns: each block sums its columns in a fixed order, and
// the last block to finish sums the blocks' partials in block order, so the result does not depend
// on which block finishes when. (One block for all columns took 13-24 us at N = 4096-8192, H200.)
constexpr int kCoefThreads = 256;

struct ColumnGrads {
  double A, B, C, bias, gamma, beta, pre, post;
};

// fold.grad_coefficients for column n.
template <class P>
__device__ ColumnGrads column_grads(const GradCoefficientProblem& p, int64_t n) {
  const FoldProblem& f = p.params;
  const int64_t N = f.N;
  const double s1 = p.sums[n], s3 = p.sums[N + n], rows = p.sums[2 * N];
  const double mean = p.moments[n], var = p.moments[N + n];
  const double b = load_or<P>(f.bias, N, n, 0.0);
  const double pre = load_or<P>(f.pre_scale, f.pre_scale_numel, n, 1.0);
  const double post = load_or<P>(f.post_scale, f.post_scale_numel, n, 1.0);
  const double gamma = load_param(static_cast<const P*>(f.gamma), n);
  const double beta = load_param(static_cast<const P*>(f.beta), n);

  const double invstd = 1.0 / sqrt(var + f.eps);
  const double alpha = pre * invstd, delta = (pre * b - mean) * invstd;  // yhat = alpha z + delta
  const double s2 = alpha * s3 + delta * s1;
  const double k = gamma * post * invstd;
  ColumnGrads r;
  r.A = pre * k;
  r.gamma = post * s2;
  r.beta = post * s1;
  r.post = gamma * s2 + beta * s1;
  double sum_du, sum_du_zb;  // sum_m du, sum_m du * (z + bias) over this batch's rows
  if (p.training) {
    // Batch terms from G1 = sum dy, G2 = sum dy * yhat over all ranks' rows (dy = post * dv, the
    // gradient at BatchNorm's output; without synchronization, this batch's), times this rank's
    // gamma, as nn.SyncBatchNorm scales the all-reduced sums by the local weight.
    double g1 = post * s1, g2 = post * s2, rows_g = rows;
    if (p.global_sums != nullptr) {
      g1 = p.global_sums[n];
      g2 = p.global_sums[N + n];
      rows_g = p.global_sums[2 * N];
    }
    const double mean_g1 = gamma * g1 / rows_g, mean_g2 = gamma * g2 / rows_g;
    r.B = -pre * invstd * alpha * mean_g2;
    r.C = -pre * invstd * (mean_g1 + delta * mean_g2);
    const double cs = p.colsum[n], css = p.colsumsq[n];
    const double sum_yhat = alpha * cs + delta * rows;
    const double sum_yhat_zb = alpha * css + (alpha * b + delta) * cs + delta * b * rows;
    sum_du = k * s1 - invstd * (rows * mean_g1 + sum_yhat * mean_g2);
    sum_du_zb = k * (s3 + b * s1) - invstd * (mean_g1 * (cs + b * rows) + mean_g2 * sum_yhat_zb);
  } else {
    r.B = 0.0;
    r.C = 0.0;
    sum_du = k * s1;
    sum_du_zb = k * (s3 + b * s1);
  }
  r.bias = pre * sum_du;
  r.pre = sum_du_zb;
  return r;
}

// Fixed-order block sum (thread 0 gets the result).
__device__ double block_sum(double v, double* scratch) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int half = kCoefThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) scratch[threadIdx.x] += scratch[threadIdx.x + half];
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();
  return total;
}

template <class P>
__global__ void __launch_bounds__(kCoefThreads)
head_grad_coefficients_kernel(GradCoefficientProblem p) {
  __shared__ double scratch[kCoefThreads];
  __shared__ bool last_block;
  const FoldProblem& f = p.params;
  const int64_t N = f.N;
  const bool pre_sum = f.pre_scale != nullptr && f.pre_scale_numel == 1;
  const bool post_sum = f.post_scale != nullptr && f.post_scale_numel == 1;
  const int64_t n = int64_t(blockIdx.x) * kCoefThreads + threadIdx.x;
  double pre_part = 0.0, post_part = 0.0;
  if (n < N) {
    const ColumnGrads r = column_grads<P>(p, n);
    p.coef[n] = float(r.A);
    p.coef[N + n] = float(r.B);
    p.coef[2 * N + n] = float(r.C);
    if (p.grad_bias != nullptr) store_param(static_cast<P*>(p.grad_bias), n, r.bias);
    store_param(static_cast<P*>(p.grad_gamma), n, r.gamma);
    store_param(static_cast<P*>(p.grad_beta), n, r.beta);
    if (pre_sum) {
      pre_part = r.pre;
    } else if (p.grad_pre != nullptr) {
      store_param(static_cast<P*>(p.grad_pre), n, r.pre);
    }
    if (post_sum) {
      post_part = r.post;
    } else if (p.grad_post != nullptr) {
      store_param(static_cast<P*>(p.grad_post), n, r.post);
    }
  }
  if (!pre_sum && !post_sum) return;  // uniform: no scale to sum over the columns
  pre_part = block_sum(pre_part, scratch);
  post_part = block_sum(post_part, scratch);
  if (threadIdx.x == 0) {
    p.scale_partials[2 * blockIdx.x] = pre_part;
    p.scale_partials[2 * blockIdx.x + 1] = post_part;
    __threadfence();  // the partials are visible before the ticket says so
    last_block = atomicAdd(p.blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  double pre_total = 0.0, post_total = 0.0;
  for (int64_t b = threadIdx.x; b < gridDim.x; b += kCoefThreads) {  // fixed order
    pre_total += __ldcg(p.scale_partials + 2 * b);
    post_total += __ldcg(p.scale_partials + 2 * b + 1);
  }
  pre_total = block_sum(pre_total, scratch);
  post_total = block_sum(post_total, scratch);
  if (threadIdx.x == 0) {
    if (pre_sum) store_param(static_cast<P*>(p.grad_pre), 0, pre_total);
    if (post_sum) store_param(static_cast<P*>(p.grad_post), 0, post_total);
  }
}

// ---- dz ---------------------------------------------------------------------------------------
// column_affine.cu's layout: a thread owns one vector of columns (its A, B, C loaded once) and
// streams a band of rows, kZRows of them loaded (as raw vectors) before any is used: with 16-bit
// operands a thread's 8 columns and their coefficients take most of its registers (~3 blocks an
// SM), and one row at a time kept ~24 KiB of loads in flight per SM. Four rows: 4096 x 4096 bf16
// 42 -> 39 us (H200); the activation's per-element switch was the rest (dispatch_activation:
// 23 us). The softmax form (which also reads out and the row term) keeps one row.
constexpr int kZThreads = 256;
template <int kVec, bool kSoftmax>
constexpr int kZRows = kVec > 1 && !kSoftmax ? 4 : 1;

template <class Z, int kVec>
__device__ __forceinline__ void store_dz(Z* dst, const float (&A)[kVec], const float (&B)[kVec],
                                         const float (&C)[kVec], const float (&dv)[kVec],
                                         const float (&z)[kVec]) {
  if constexpr (kVec > 1) {
    Vec<Z, kVec> v;
#pragma unroll
    for (int j = 0; j < kVec; ++j) v.v[j] = from_float<Z>(fmaf(A[j], dv[j], fmaf(B[j], z[j], C[j])));
    *reinterpret_cast<Vec<Z, kVec>*>(dst) = v;
  } else {
    *dst = from_float<Z>(fmaf(A[0], dv[0], fmaf(B[0], z[0], C[0])));
  }
}

template <class G, class Z, int kVec, bool kSoftmax>
__global__ void __launch_bounds__(kZThreads)
head_grad_z_kernel(GradOperands o, const float* __restrict__ coef, Z* __restrict__ dz,
                   int64_t ld_dz, int64_t rows_per_block) {
  constexpr int kRows = kZRows<kVec, kSoftmax>;
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (col >= o.N) return;  // kVec > 1 implies N % kVec == 0
  float A[kVec], B[kVec], C[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    A[j] = __ldg(coef + col + j);
    B[j] = __ldg(coef + o.N + col + j);
    C[j] = __ldg(coef + 2 * o.N + col + j);
  }
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_block;
  const int64_t r1 = std::min<int64_t>(o.M, r0 + rows_per_block);
  dispatch_activation(o.act.kind, [&](auto kind) {
    const ActivationGrad<kVec, decltype(kind)::value> act_grad(o, col);
    int64_t row = r0;
    if constexpr (kRows > 1) {
      const G* g = static_cast<const G*>(o.g) + col;
      const Z* zp = static_cast<const Z*>(o.z) + col;
      for (; row + kRows <= r1; row += kRows) {
        RowVec<G, kVec> gv[kRows];
        RowVec<Z, kVec> zv[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          gv[i].load(g + (row + i) * o.ld_g);
          zv[i].load(zp + (row + i) * o.ld_z);
        }
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          float dv[kVec], z[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            z[j] = zv[i][j];
            dv[j] = act_grad(gv[i][j], z[j], j);
          }
          store_dz<Z, kVec>(dz + (row + i) * ld_dz + col, A, B, C, dv, z);
        }
      }
    }
    for (; row < r1; ++row) {
      float dv[kVec], z[kVec];
      load_dv_z<G, Z, kVec, kSoftmax>(o, row, col, dv, z);
#pragma unroll
      for (int j = 0; j < kVec; ++j) dv[j] = act_grad(dv[j], z[j], j);
      store_dz<Z, kVec>(dz + row * ld_dz + col, A, B, C, dv, z);
    }
  });
}

template <class G, class Z, int kVec, bool kSoftmax>
void launch_z(const GradOperands& o, const float* coef, Z* dz, int64_t ld_dz, cudaStream_t stream) {
  constexpr int kRows = kZRows<kVec, kSoftmax>;
  const int64_t vecs = o.N / kVec;
  const int64_t col_blocks = (vecs + kZThreads - 1) / kZThreads;
  // One wave of the blocks that fit (the registers decide how many), bands of at least kRows rows
  // (at least 4).
  static const int per_sm = [] {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, head_grad_z_kernel<G, Z, kVec, kSoftmax>,
                                                  kZThreads, 0);
    return std::max(n, 1);
  }();
  const int64_t sms = std::max(sm_count(current_device()), 1);
  const int64_t want = std::max<int64_t>(1, sms * per_sm / col_blocks);
  const int64_t min_rows = std::max(kRows, 4);
  const int64_t bands = std::min<int64_t>({want, (o.M + min_rows - 1) / min_rows, 65535});
  const int64_t rows_per_block = (o.M + bands - 1) / bands;
  const dim3 grid(unsigned(col_blocks), unsigned((o.M + rows_per_block - 1) / rows_per_block));
  head_grad_z_kernel<G, Z, kVec, kSoftmax><<<grid, kZThreads, 0, stream>>>(o, coef, dz, ld_dz,
                                                                           rows_per_block);
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

// The band width head_grad_sums will run these operands with (kSumsCols of their vector width).
int sums_cols(const GradOperands& o) {
  int cols = 32;
  dispatch_grad(o, true,
                [&](auto, auto, auto width, auto) { cols = kSumsCols<decltype(width)::value>; });
  return cols;
}

}  // namespace

void softmax_grad_rowdot(const GradOperands& o, float* rowdot, cudaStream_t stream) {
  if (o.M == 0) return;
  dispatch_grad(o, true, [&](auto g_tag, auto, auto width, auto) {
    launch_rowdot<decltype(g_tag), decltype(width)::value>(o, rowdot, stream);
  });
  check_launch("softmax_grad_rowdot");
}

size_t head_grad_sums_scratch_bytes(const GradOperands& o) {
  if (o.N == 0) return 0;
  const int splits = sums_row_splits(o, sums_cols(o));
  return splits > 1 ? sizeof(double) * size_t(2 * o.N) * size_t(splits) : 0;
}

void head_grad_sums(const GradOperands& o, double* sums, void* scratch, cudaStream_t stream) {
  if (o.N == 0) return;  // the op layer writes the lone row count
  const int splits = sums_row_splits(o, sums_cols(o));
  if (splits > 1 && scratch == nullptr) throw std::runtime_error("head_grad_sums: scratch is null");
  dispatch_grad(o, true, [&](auto g_tag, auto z_tag, auto width, auto softmax) {
    launch_sums<decltype(g_tag), decltype(z_tag), decltype(width)::value, decltype(softmax)::value>(
        o, sums, static_cast<double*>(scratch), splits, stream);
  });
  check_launch("head_grad_sums");
}

size_t head_grad_coefficients_scratch_bytes(const FoldProblem& f) {
  const bool scalar_scale = (f.pre_scale != nullptr && f.pre_scale_numel == 1) ||
                            (f.post_scale != nullptr && f.post_scale_numel == 1);
  if (!scalar_scale || f.N == 0) return 0;
  const int64_t blocks = (f.N + kCoefThreads - 1) / kCoefThreads;
  return size_t(blocks) * 2 * sizeof(double) + sizeof(double);  // partials, then the ticket
}

void head_grad_coefficients(const GradCoefficientProblem& p, void* scratch, cudaStream_t stream) {
  if (p.params.N == 0) return;
  const int64_t blocks = (p.params.N + kCoefThreads - 1) / kCoefThreads;
  if (blocks > INT_MAX) throw std::runtime_error("head_grad_coefficients: too many columns");
  GradCoefficientProblem q = p;
  if (head_grad_coefficients_scratch_bytes(p.params) > 0) {
    if (scratch == nullptr) throw std::runtime_error("head_grad_coefficients: scratch is null");
    q.scale_partials = static_cast<double*>(scratch);
    q.blocks_done = reinterpret_cast<unsigned*>(q.scale_partials + 2 * blocks);
    // Only the counter must start at zero (the partials are written before they are read): a
    // 4-byte memset, where zeroing the scratch with at::zeros cost a fill kernel and ~20 us of
    // host time per backward (H100 machine).
    cudaMemsetAsync(q.blocks_done, 0, sizeof(unsigned), stream);  // an error surfaces in check_launch
  }
  dispatch_dtype(p.params.param_dtype, [&](auto tag) {
    head_grad_coefficients_kernel<decltype(tag)><<<unsigned(blocks), kCoefThreads, 0, stream>>>(q);
  });
  check_launch("head_grad_coefficients");
}

void head_grad_z(const GradOperands& o, const float* coef, void* dz, int64_t ld_dz,
                 cudaStream_t stream) {
  if (o.M == 0 || o.N == 0) return;
  dispatch_grad(o, is_aligned16(dz), [&](auto g_tag, auto z_tag, auto width, auto softmax) {
    using G = decltype(g_tag);
    using Z = decltype(z_tag);
    constexpr int kVec = decltype(width)::value;
    if (kVec > 1 && ld_dz % kVec != 0) {
      launch_z<G, Z, 1, decltype(softmax)::value>(o, coef, static_cast<Z*>(dz), ld_dz, stream);
    } else {
      launch_z<G, Z, kVec, decltype(softmax)::value>(o, coef, static_cast<Z*>(dz), ld_dz, stream);
    }
  });
  check_launch("head_grad_z");
}

}  // namespace epifuse
