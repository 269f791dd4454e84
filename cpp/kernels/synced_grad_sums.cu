// The backward of synchronized batch statistics, before the all_reduce the op layer runs: this
// batch's row [G1, G2, M] of sums at BatchNorm's output (fold.normalized_grad_sums, the reference),
// per column G1 = sum dy = post * S1 and G2 = sum dy * yhat = post * (alpha * S3 + delta * S1),
// yhat = alpha * z + delta the normalized input: the sums of dy and dy * (u - mean) * invstd that
// nn.SyncBatchNorm all-reduces, which ranks on the reference path send too. A thread per column,
// fp64.
#include "epifuse/sync_kernels.h"
#include "per_column.cuh"

namespace epifuse {
namespace {

template <class P>
__global__ void __launch_bounds__(kColumnThreads)
normalized_grad_sums_kernel(FoldProblem f, const double* __restrict__ sums,
                            const double* __restrict__ moments, double* __restrict__ out) {
  const int64_t N = f.N;
  EPIFUSE_FOR_EACH_COLUMN(n, N) {
    const ColumnScales s = column_scales<P>(f, n);
    const double invstd = 1.0 / sqrt(moments[N + n] + f.eps);
    const double alpha = s.pre * invstd, delta = (s.pre * s.bias - moments[n]) * invstd;
    const double s1 = sums[n], s3 = sums[N + n];
    out[n] = s.post * s1;
    out[N + n] = s.post * (alpha * s3 + delta * s1);
  }
  if (first_thread()) out[2 * N] = sums[2 * N];  // the row count, as the sums carry it
}

}  // namespace

void normalized_grad_sums(const FoldProblem& f, const double* sums, const double* moments,
                          double* out, cudaStream_t stream) {
  launch_per_column(f, "normalized_grad_sums", [&](auto tag, unsigned blocks) {
    normalized_grad_sums_kernel<decltype(tag)>
        <<<blocks, kColumnThreads, 0, stream>>>(f, sums, moments, out);
  });
}

}  // namespace epifuse
