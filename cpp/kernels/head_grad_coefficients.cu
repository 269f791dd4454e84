// The head backward's per-column coefficients (head_grad.cuh lists the passes): from the column
// sums, dz = A * dv + B * z + C per column and the gradients of bias, BatchNorm's gamma / beta and
// the scales (fold.grad_coefficients in python/epifuse/fold.py is the reference), in fp64.
#include <climits>
#include <stdexcept>

#include "cuda_utils.cuh"

namespace epifuse {
namespace {

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

}  // namespace

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

}  // namespace epifuse
