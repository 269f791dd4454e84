// The BatchNorm fold: per-column (a, c) with y = a[n] * z[m, n] + c[n], where z = x . W^T and
//   y = post_scale * BatchNorm(pre_scale * (z + bias)),   BatchNorm(u) = gamma * (u - mu) * invstd + beta.
// Training mode takes mu / var from the batch (colsum, colsumsq over `count` rows) and updates the
// running statistics as nn.BatchNorm1d does (bn_fold_batch: writes the batch moments instead, for the
// backward, and leaves the running statistics alone); eval mode reads the running statistics.
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

// P: the parameters' type; S: the running statistics' (P, or double when eval folds from the
// float64 moments a backward kept).
template <class P, class S>
__global__ void __launch_bounds__(kCumulativeThreads)
bn_fold_kernel(FoldProblem f, const double* __restrict__ colsum, const double* __restrict__ colsumsq,
               int64_t count, S* running_mean, S* running_var, int64_t* num_batches_tracked,
               double momentum, bool training, double* moments) {
  // Null running statistics in training: bn_fold_batch, which writes `moments` instead.
  const bool update = training && running_mean != nullptr;
  // momentum None: cumulative average over the batches seen, counting this one.
  const double factor =
      (update && momentum < 0) ? 1.0 / double(*num_batches_tracked + 1) : momentum;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < f.N; n += stride) {
    const double bias = load_or<P>(f.bias, f.N, n, 0.0);
    const double pre = load_or<P>(f.pre_scale, f.pre_scale_numel, n, 1.0);
    const double post = load_or<P>(f.post_scale, f.post_scale_numel, n, 1.0);
    const double gamma = load_param(static_cast<const P*>(f.gamma), n);
    const double beta = load_param(static_cast<const P*>(f.beta), n);
    double mu, invstd;
    if (training) {
      const double mean_z = colsum[n] / double(count);
      // Clamp rounding below zero, but let NaN through (fmax would turn it into 0): a NaN or Inf
      // in the batch must poison the statistics as it does in PyTorch.
      const double raw_var = colsumsq[n] / double(count) - mean_z * mean_z;
      const double var_z = raw_var < 0.0 ? 0.0 : raw_var;
      mu = pre * (mean_z + bias);
      const double var_u = pre * pre * var_z;  // biased, as BatchNorm normalizes with
      invstd = 1.0 / sqrt(var_u + f.eps);
      if (update) {
        const double unbiased = var_u * double(count) / double(count - 1);
        store_param(running_mean, n, (1.0 - factor) * load_param(running_mean, n) + factor * mu);
        store_param(running_var, n, (1.0 - factor) * load_param(running_var, n) + factor * unbiased);
      }
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
  if (update) {
    // momentum=None: the launch is one block, and the barrier orders every read of the counter
    // before the increment. Otherwise nothing reads it and block 0 increments it once.
    if (momentum < 0) __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) *num_batches_tracked += 1;
  }
}

template <class P, class S>
void launch_typed(const FoldProblem& f, const double* colsum, const double* colsumsq, int64_t count,
                  void* running_mean, void* running_var, int64_t* num_batches_tracked,
                  double momentum, bool training, double* moments, cudaStream_t stream) {
  const bool cumulative = training && running_mean != nullptr && momentum < 0;
  const int64_t blocks = cumulative ? 1 : std::max<int64_t>((f.N + kFoldThreads - 1) / kFoldThreads, 1);
  const int threads = cumulative ? kCumulativeThreads : kFoldThreads;
  bn_fold_kernel<P, S><<<unsigned(std::min<int64_t>(blocks, 65535)), threads, 0, stream>>>(
      f, colsum, colsumsq, count, static_cast<S*>(running_mean), static_cast<S*>(running_var),
      num_batches_tracked, momentum, training, moments);
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
  check_launch(!training ? "bn_fold_eval" : moments ? "bn_fold_batch" : "bn_fold_train");
}

}  // namespace

void bn_fold_train(const FoldProblem& f, const double* colsum, const double* colsumsq, int64_t count,
                   void* running_mean, void* running_var, int64_t* num_batches_tracked,
                   double momentum, cudaStream_t stream) {
  launch(f, colsum, colsumsq, count, running_mean, running_var, num_batches_tracked, momentum,
         /*training=*/true, /*moments=*/nullptr, stream);
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

}  // namespace epifuse
