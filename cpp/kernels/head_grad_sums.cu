// The head backward's column sums (head_grad.cuh lists the passes): per column S1 = sum_m dv and
// S3 = sum_m dv * z in fp64, one pass over g, out and z; deterministic (each column's rows in
// splits by one block each in a fixed order, then the splits by sum_tile_partials).
#include <algorithm>
#include <stdexcept>
#include <type_traits>

#include "cuda_utils.cuh"
#include "head_grad.cuh"
#include "tile_partials.hpp"

namespace epifuse {
namespace {

using head_grad::ActivationGrad;
using head_grad::dispatch_grad;
using head_grad::load_dv_z;
using head_grad::RowVec;

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

// The band width head_grad_sums will run these operands with (kSumsCols of their vector width).
int sums_cols(const GradOperands& o) {
  int cols = 32;
  dispatch_grad(o, true,
                [&](auto, auto, auto width, auto) { cols = kSumsCols<decltype(width)::value>; });
  return cols;
}

}  // namespace

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

}  // namespace epifuse
