// The BatchNorm fold: per-column (a, c) with y = a[n] * z[m, n] + c[n], where z = x . W^T and
//   y = post_scale * BatchNorm(pre_scale * (z + bias)),   BatchNorm(u) = gamma * (u - mu) * invstd + beta.
// Training mode takes mu / var from the batch (colsum, colsumsq over `count` rows) and updates the
// running statistics as nn.BatchNorm1d does; eval mode reads the running statistics.
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

__device__ __forceinline__ double load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ double load(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ double load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, int64_t i, double v) { p[i] = float(v); }
__device__ __forceinline__ void store(__half* p, int64_t i, double v) { p[i] = __double2half(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, double v) {
  p[i] = __float2bfloat16_rn(float(v));
}

template <class P>
__device__ __forceinline__ double load_or(const void* p, int64_t numel, int64_t n, double fallback) {
  if (p == nullptr) return fallback;
  return load(static_cast<const P*>(p), numel == 1 ? 0 : n);
}

template <class P>
__global__ void __launch_bounds__(kCumulativeThreads)
bn_fold_kernel(FoldProblem f, const double* __restrict__ colsum, const double* __restrict__ colsumsq,
               int64_t count, P* running_mean, P* running_var, int64_t* num_batches_tracked,
               double momentum, bool training) {
  // momentum None: cumulative average over the batches seen, counting this one.
  const double factor =
      (training && momentum < 0) ? 1.0 / double(*num_batches_tracked + 1) : momentum;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < f.N; n += stride) {
    const double bias = load_or<P>(f.bias, f.N, n, 0.0);
    const double pre = load_or<P>(f.pre_scale, f.pre_scale_numel, n, 1.0);
    const double post = load_or<P>(f.post_scale, f.post_scale_numel, n, 1.0);
    const double gamma = load(static_cast<const P*>(f.gamma), n);
    const double beta = load(static_cast<const P*>(f.beta), n);
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
      const double unbiased = var_u * double(count) / double(count - 1);
      store(running_mean, n, (1.0 - factor) * load(running_mean, n) + factor * mu);
      store(running_var, n, (1.0 - factor) * load(running_var, n) + factor * unbiased);
    } else {
      mu = load(running_mean, n);
      invstd = 1.0 / sqrt(load(running_var, n) + f.eps);
    }
    f.a[n] = float(post * gamma * invstd * pre);
    f.c[n] = float(post * (gamma * invstd * (pre * bias - mu) + beta));
  }
  if (training) {
    // momentum=None: the launch is one block, and the barrier orders every read of the counter
    // before the increment. Otherwise nothing reads it and block 0 increments it once.
    if (momentum < 0) __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) *num_batches_tracked += 1;
  }
}

void launch(const FoldProblem& f, const double* colsum, const double* colsumsq, int64_t count,
            void* running_mean, void* running_var, int64_t* num_batches_tracked, double momentum,
            bool training, cudaStream_t stream) {
  if (f.N == 0 && !training) return;
  dispatch_dtype(f.param_dtype, [&](auto tag) {
    using P = decltype(tag);
    const bool cumulative = training && momentum < 0;
    const int64_t blocks = cumulative ? 1 : std::max<int64_t>((f.N + kFoldThreads - 1) / kFoldThreads, 1);
    const int threads = cumulative ? kCumulativeThreads : kFoldThreads;
    bn_fold_kernel<P><<<unsigned(std::min<int64_t>(blocks, 65535)), threads, 0, stream>>>(
        f, colsum, colsumsq, count, static_cast<P*>(running_mean), static_cast<P*>(running_var),
        num_batches_tracked, momentum, training);
  });
  check_launch(training ? "bn_fold_train" : "bn_fold_eval");
}

}  // namespace

void bn_fold_train(const FoldProblem& f, const double* colsum, const double* colsumsq, int64_t count,
                   void* running_mean, void* running_var, int64_t* num_batches_tracked,
                   double momentum, cudaStream_t stream) {
  launch(f, colsum, colsumsq, count, running_mean, running_var, num_batches_tracked, momentum,
         /*training=*/true, stream);
}

void bn_fold_eval(const FoldProblem& f, const void* running_mean, const void* running_var,
                  cudaStream_t stream) {
  launch(f, nullptr, nullptr, 0, const_cast<void*>(running_mean), const_cast<void*>(running_var),
         nullptr, 0.0, /*training=*/false, stream);
}

}  // namespace epifuse
