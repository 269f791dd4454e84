// The forward of synchronized batch statistics, around the all_gather the op layer runs:
//   pack_moments  this rank's [count, mean, M2] row of u = pre_scale * (z + bias)
//   merge_fold    all ranks' rows merged (Chan et al.), then the fold with the merged moments
// A thread per column, fp64 throughout. The rows are merged about their mean rather than from
// pooled sums of u and u^2, so no E[u^2] - E[u]^2 cancellation happens across ranks, and unequal
// (or empty) batches are weighted exactly. python/epifuse/distributed.py (pack_moments,
// merge_moments) and fold.py (input_moments, fold_batch) are the reference.
#include "epifuse/sync_kernels.h"
#include "per_column.cuh"

namespace epifuse {
namespace {

template <class P>
__global__ void __launch_bounds__(kColumnThreads)
pack_moments_kernel(FoldProblem f, const double* __restrict__ colsum,
                    const double* __restrict__ colsumsq, int64_t count, double* __restrict__ row) {
  const int64_t N = f.N;
  const double rows = double(count);
  EPIFUSE_FOR_EACH_COLUMN(n, N) {
    const ColumnScales s = column_scales<P>(f, n);
    const ColumnMoments z = column_moments(colsum[n], colsumsq[n], rows);
    row[1 + n] = s.pre * (z.mean + s.bias);
    row[1 + N + n] = s.pre * s.pre * z.var * rows;  // M2 = count * biased variance of u
  }
  if (first_thread()) row[0] = rows;
}

// Rank r's row of the gathered [world, 2N + 1] rows.
struct RankRows {
  const double* rows;
  int64_t N, world;

  __device__ double count(int64_t r) const { return rows[r * (2 * N + 1)]; }
  __device__ double mean(int64_t r, int64_t n) const { return rows[r * (2 * N + 1) + 1 + n]; }
  __device__ double m2(int64_t r, int64_t n) const { return rows[r * (2 * N + 1) + 1 + N + n]; }
};

struct Moments {
  double mean, var;
};

// distributed.merge_moments for column n over `total` rows: the count-weighted mean, then the sum
// of the ranks' M2 plus the sum of count * (rank mean - mean)^2, each about the merged mean.
// Empty ranks are skipped rather than weighted by 0, so that whatever their row holds adds nothing.
__device__ Moments merge_column(const RankRows& r, int64_t n, double total) {
  double weighted = 0.0;
  for (int64_t k = 0; k < r.world; ++k) {
    if (r.count(k) != 0.0) weighted += r.count(k) * r.mean(k, n);
  }
  const double mean = weighted / total;
  double m2 = 0.0, spread = 0.0;
  for (int64_t k = 0; k < r.world; ++k) {
    if (r.count(k) == 0.0) continue;
    const double d = r.mean(k, n) - mean;
    m2 += r.m2(k, n);
    spread += r.count(k) * d * d;
  }
  return {mean, (m2 + spread) / total};
}

template <class P>
__global__ void __launch_bounds__(kColumnThreads)
merge_fold_kernel(FoldProblem f, RankRows rows, double* __restrict__ moments) {
  const int64_t N = f.N;
  double total = 0.0;  // every thread sums the counts: a few ranks' worth of loads
  for (int64_t k = 0; k < rows.world; ++k) total += rows.count(k);
  EPIFUSE_FOR_EACH_COLUMN(n, N) {
    const Moments m = merge_column(rows, n, total);
    const ColumnScales s = column_scales<P>(f, n);
    const double gamma = load_param(static_cast<const P*>(f.gamma), n);
    const double beta = load_param(static_cast<const P*>(f.beta), n);
    const double invstd = 1.0 / sqrt(m.var + f.eps);
    const double g = gamma * invstd;  // fold._affine, in its order
    f.a[n] = float(s.post * g * s.pre);
    f.c[n] = float(s.post * (g * (s.pre * s.bias - m.mean) + beta));
    moments[n] = m.mean;
    moments[N + n] = m.var;
  }
  if (first_thread()) moments[2 * N] = total;
}

}  // namespace

void pack_moments(const FoldProblem& f, const double* colsum, const double* colsumsq, int64_t count,
                  double* row, cudaStream_t stream) {
  launch_per_column(f, "pack_moments", [&](auto tag, unsigned blocks) {
    pack_moments_kernel<decltype(tag)>
        <<<blocks, kColumnThreads, 0, stream>>>(f, colsum, colsumsq, count, row);
  });
}

void merge_fold(const FoldProblem& f, const double* rows, int64_t world, double* moments,
                cudaStream_t stream) {
  const RankRows gathered{rows, f.N, world};
  launch_per_column(f, "merge_fold", [&](auto tag, unsigned blocks) {
    merge_fold_kernel<decltype(tag)><<<blocks, kColumnThreads, 0, stream>>>(f, gathered, moments);
  });
}

}  // namespace epifuse
