// The BatchNorm fold: per-column (a, c) with y = a[n] * z[m, n] + c[n], where z = x . W^T and
//   y = post_scale * BatchNorm(pre_scale * (z + bias)),   BatchNorm(u) = gamma * (u - mu) * invstd + beta.
// Training mode takes mu / var from the batch (colsum, colsumsq over `count` rows), writes the batch
// moments for the backward and updates the running statistics as nn.BatchNorm1d does (bn_fold_train;
// bn_fold_batch leaves them alone); eval mode reads the running statistics.
// update_running_stats: the running-statistics update alone, from the moments the synchronized fold
// wrote (its merged statistics are only known after the collective).
// python/epifuse/fold.py is the reference for this math; tests hold this kernel to it.
//
// One thread per column over as many blocks as the columns need (the fold is a few fp64 divisions
// and a square root per column: latency-bound, so spread wide). One exception: momentum=None in
// training reads num_batches_tracked in every thread to form the cumulative-average factor, and the
// increment must follow every read, which only a block barrier can order: that case runs one block.
// All arithmetic is fp64 (the sums are fp64, and E[z^2] - E[z]^2 must not lose the variance).
#include <algorithm>

#include "cuda_utils.cuh"

namespace epifuse {
namespace {

constexpr int kFoldThreads = 256;          // per block, one column per thread
constexpr int kCumulativeThreads = 1024;   // the single block of momentum=None training

// nn.BatchNorm's update of column n: the running variance tracks the unbiased variance.
template <class S>
__device__ __forceinline__ void update_column(S* running_mean, S* running_var, int64_t n, double mu,
                                              double var_u, double count, double factor) {
  const double unbiased = var_u * count / (count - 1.0);
  store_param(running_mean, n, (1.0 - factor) * load_param(running_mean, n) + factor * mu);
  store_param(running_var, n, (1.0 - factor) * load_param(running_var, n) + factor * unbiased);
}

// momentum None (< 0): the cumulative average over the batches seen, counting this one.
__device__ __forceinline__ double update_factor(double momentum, const int64_t* num_batches_tracked) {
  return momentum < 0 ? 1.0 / double(*num_batches_tracked + 1) : momentum;
}

// After every column's update: momentum=None's launch is one block, and the barrier orders every
// read of the counter before the increment. Otherwise nothing reads it and block 0 increments it.
__device__ __forceinline__ void count_batch(double momentum, int64_t* num_batches_tracked) {
  if (momentum < 0) __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0) *num_batches_tracked += 1;
}

// P: the parameters' type; S: the running statistics' (P, or double when eval folds from the
// float64 moments a backward kept).
template <class P, class S>
__global__ void __launch_bounds__(kCumulativeThreads)
bn_fold_kernel(FoldProblem f, const double* __restrict__ colsum, const double* __restrict__ colsumsq,
               int64_t count, S* running_mean, S* running_var, int64_t* num_batches_tracked,
               double momentum, bool training, double* moments) {
  // Null running statistics in training: bn_fold_batch, which only writes `moments`.
  const bool update = training && running_mean != nullptr;
  const double factor = update ? update_factor(momentum, num_batches_tracked) : 0.0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < f.N; n += stride) {
    const double bias = load_or<P>(f.bias, f.N, n, 0.0);
    const double pre = load_or<P>(f.pre_scale, f.pre_scale_numel, n, 1.0);
    const double post = load_or<P>(f.post_scale, f.post_scale_numel, n, 1.0);
    const double gamma = load_param(static_cast<const P*>(f.gamma), n);
    const double beta = load_param(static_cast<const P*>(f.beta), n);
    double mu, invstd;
    if (training) {
      const ColumnMoments z = column_moments(colsum[n], colsumsq[n], double(count));
      mu = pre * (z.mean + bias);
      const double var_u = pre * pre * z.var;  // biased, as BatchNorm normalizes with
      invstd = 1.0 / sqrt(var_u + f.eps);
      if (update) update_column(running_mean, running_var, n, mu, var_u, double(count), factor);
      if (moments != nullptr) {
        moments[n] = mu;
        moments[f.N + n] = var_u;
      }
    } else {
      mu = load_param(running_mean, n);
      invstd = 1.0 / sqrt(load_param(running_var, n) + f.eps);
    }
    f.a[n] = float(post * gamma * invstd * pre);
    f.c[n] = float(post * (gamma * invstd * (pre * bias - mu) + beta));
  }
  if (moments != nullptr && blockIdx.x == 0 && threadIdx.x == 0) moments[2 * f.N] = double(count);
  if (update) count_batch(momentum, num_batches_tracked);
}

// moments: [mean (N), biased variance (N), count]; the count is read on the device (a synchronized
// batch's lives there), unchecked, as nn.SyncBatchNorm uses it.
template <class S>
__global__ void __launch_bounds__(kCumulativeThreads)
running_stats_kernel(int64_t N, const double* __restrict__ moments, S* running_mean, S* running_var,
                     int64_t* num_batches_tracked, double momentum) {
  const double factor = update_factor(momentum, num_batches_tracked);
  const double count = moments[2 * N];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += stride) {
    update_column(running_mean, running_var, n, moments[n], moments[N + n], count, factor);
  }
  count_batch(momentum, num_batches_tracked);
}

// Columns per launch: one block of kCumulativeThreads for momentum=None, else kFoldThreads a block.
template <class Kernel, class... Args>
void launch_columns(Kernel kernel, int64_t N, bool cumulative, cudaStream_t stream, Args... args) {
  const int64_t blocks = cumulative ? 1 : std::max<int64_t>((N + kFoldThreads - 1) / kFoldThreads, 1);
  const int threads = cumulative ? kCumulativeThreads : kFoldThreads;
  kernel<<<unsigned(std::min<int64_t>(blocks, 65535)), threads, 0, stream>>>(args...);
}

template <class P, class S>
void launch_typed(const FoldProblem& f, const double* colsum, const double* colsumsq, int64_t count,
                  void* running_mean, void* running_var, int64_t* num_batches_tracked,
                  double momentum, bool training, double* moments, cudaStream_t stream) {
  const bool cumulative = training && running_mean != nullptr && momentum < 0;
  launch_columns(bn_fold_kernel<P, S>, f.N, cumulative, stream, f, colsum, colsumsq, count,
                 static_cast<S*>(running_mean), static_cast<S*>(running_var), num_batches_tracked,
                 momentum, training, moments);
}

// stats_fp64: the running statistics are float64 (eval only), else the parameters' dtype.
void launch(const FoldProblem& f, const double* colsum, const double* colsumsq, int64_t count,
            void* running_mean, void* running_var, int64_t* num_batches_tracked, double momentum,
            bool training, double* moments, cudaStream_t stream, bool stats_fp64 = false) {
  if (f.N == 0 && !training) return;
  dispatch_dtype(f.param_dtype, [&](auto tag) {
    using P = decltype(tag);
    if (stats_fp64) {
      launch_typed<P, double>(f, colsum, colsumsq, count, running_mean, running_var,
                              num_batches_tracked, momentum, training, moments, stream);
    } else {
      launch_typed<P, P>(f, colsum, colsumsq, count, running_mean, running_var,
                         num_batches_tracked, momentum, training, moments, stream);
    }
  });
  check_launch(!training ? "bn_fold_eval" : running_mean ? "bn_fold_train" : "bn_fold_batch");
}

}  // namespace

void bn_fold_train(const FoldProblem& f, const double* colsum, const double* colsumsq, int64_t count,
                   void* running_mean, void* running_var, int64_t* num_batches_tracked,
                   double momentum, double* moments, cudaStream_t stream) {
  launch(f, colsum, colsumsq, count, running_mean, running_var, num_batches_tracked, momentum,
         /*training=*/true, moments, stream);
}

void bn_fold_batch(const FoldProblem& f, const double* colsum, const double* colsumsq,
                   int64_t count, double* moments, cudaStream_t stream) {
  launch(f, colsum, colsumsq, count, nullptr, nullptr, nullptr, 0.0, /*training=*/true, moments,
         stream);
}

void bn_fold_eval(const FoldProblem& f, const void* running_mean, const void* running_var,
                  bool stats_fp64, cudaStream_t stream) {
  launch(f, nullptr, nullptr, 0, const_cast<void*>(running_mean), const_cast<void*>(running_var),
         nullptr, 0.0, /*training=*/false, /*moments=*/nullptr, stream, stats_fp64);
}

void update_running_stats(int64_t N, DType stats_dtype, const double* moments, void* running_mean,
                          void* running_var, int64_t* num_batches_tracked, double momentum,
                          cudaStream_t stream) {
  dispatch_dtype(stats_dtype, [&](auto tag) {
    using S = decltype(tag);
    launch_columns(running_stats_kernel<S>, N, momentum < 0, stream, N, moments,
                   static_cast<S*>(running_mean), static_cast<S*>(running_var),
                   num_batches_tracked, momentum);
  });
  check_launch("update_running_stats");
}

}  // namespace epifuse
