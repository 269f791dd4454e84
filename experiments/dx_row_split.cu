// Can the backward's dX = dZ . W read W's row split (the forward's kind) instead of a split of W^T?
//
// Today (backward_matmul, split_fp16.cu) dX's 3x product splits W^T: the exponents are per column
// of W (dX's output column k needs one scale over the reduction n), so W is read as a transposed
// view: a pass for its columns' maxima, then the split in 64 x 64 tiles, ~1.7x the row path's
// time (problem 84: ~0.24 ms against ~0.13 for 256 MiB of fp32 weight). The alternative measured
// here moves W's scale to the other operand:
//     dX[m, k] = sum_n dZ[m, n] W[n, k] = sum_n (dZ[m, n] 2^e_w[n]) (W[n, k] 2^-e_w[n])
// so W is split by rows (e_w[n] from its row's maximum, one read and one write) and dZ' =
// dZ . diag(2^e_w), exact in fp32, is split by its own rows (e[m]); the epilogue scales by 2^e[m]
// alone. The 3x mainloop pairs hi and lo along K in blocks of 32: for W as B, K is W's rows, so
// the split writes W's row n hi to row 64 (n / 32) + n % 32 and lo 32 rows further, and the GEMM
// reads B MN-major ([2 Np, K] row-major), which FP16 wgmma takes from shared memory.
//
// Measured: each path's splits and GEMM (best of 20 with an L2 flush), and the error against
// float64 (cuBLAS DGEMM) beside cuBLAS SGEMM's, at problem 84's dX (M = 1024, N = K = 8192) and
// problem 39's (16384 x 4096 x 4096), also with W's rows scaled by 2^-8..2^8 (the scaled-rows
// case: W's exponents then spread dZ''s rows over 16 binades).
//
//   CL=<site-packages>/cutlass_library/source NV=<site-packages>/nvidia/cu13
//   /usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DNDEBUG \
//        --expt-relaxed-constexpr -I$CL/include -I$CL/tools/util/include -Icpp/include \
//        -Icpp/kernels -I$NV/include -L$NV/lib experiments/dx_row_split.cu \
//        -l:libcublas.so.13 -o build/experiments/dx_row_split
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>

#include "library_3x.cuh"

using namespace cute;

// ---- W split by rows, laid out as the 3x mainloop's B read MN-major ------------------------------
// One block per row n of W [N, K]: e_w[n] = ilogb(max_k |W[n, k]|) - 14 (0 for a zero row), as
// split_fp16 does; hi = fp16(v 2^-e), lo = fp16(v 2^-e - hi) into rows 64 (n / 32) + n % 32 and
// that + 32 of parts [2 Np, ldk]. Finite W only (the library would flag rows, as split_fp16 does).
__global__ void split_rows_as_mn_major_b(const float* __restrict__ w, int N, int K,
                                         __half* __restrict__ parts, int64_t ldk,
                                         float* __restrict__ e_w) {
  const int n = blockIdx.x;
  const float* row = w + int64_t(n) * K;
  float m = 0.f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) m = fmaxf(m, fabsf(row[k]));
  __shared__ float warp_max[32];
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  m = 0.f;
  for (int i = 0; i < int(blockDim.x / 32); ++i) m = fmaxf(m, warp_max[i]);
  const int e = m > 0.f ? ilogbf(m) - 14 : 0;
  const float scale = ldexpf(1.f, -e);  // exact: e stays within fp32's normal range here
  if (threadIdx.x == 0) e_w[n] = float(e);
  __half* hi = parts + (int64_t(n / 32) * 64 + n % 32) * ldk;
  __half* lo = hi + 32 * ldk;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const float v = row[k] * scale;
    const __half h = __float2half_rn(v);
    hi[k] = h;
    lo[k] = __float2half_rn(v - __half2float(h));
  }
}

// dZ'[m, n] = dZ[m, n] 2^e_w[n] (exact while it stays normal).
__global__ void scale_columns(int64_t rows, int cols, const float* __restrict__ dz,
                              const float* __restrict__ e_w, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = ldexpf(dz[i], int(e_w[i % cols]));
}

__global__ void scale_rows(int rows, int cols, float* w, int spread) {  // w[n, :] *= 2^(n % 17 - 8)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(rows) * cols;
       i += int64_t(gridDim.x) * blockDim.x)
    w[i] = ldexpf(w[i], int((i / cols) % (2 * spread + 1)) - spread);
}

using Tree = epifuse::evt::PerColumnAffine<Shape<_128, _128, _64>, float,
                                           epifuse::evt::ScaledAccFetch<Shape<_128, _128, _64>>>;
using KMajorB = SplitGemm<cutlass::half_t, _64, Tree>;
using MnMajorB = SplitGemm<cutlass::half_t, _64, Tree, cutlass::layout::RowMajor>;

// Room for the largest shape run (M, N, K up to 16384, 8192, 8192).
struct Bufs {
  static constexpr size_t kMN = size_t(16384) * 8192, kNK = size_t(8192) * 8192, kMK = kMN;
  float* dz = device_buffer<float>(kMN);
  float* dzs = device_buffer<float>(kMN);  // dZ' = dZ 2^e_w
  float* w = device_buffer<float>(kNK);
  float* d = device_buffer<float>(kMK);
  float* d2 = device_buffer<float>(kMK);
  float* zeros = device_buffer<float>(8192);  // B's exponents in the row-split product
  float* e_w = device_buffer<float>(8192);
  double* dzd = device_buffer<double>(kMN);
  double* wd = device_buffer<double>(kNK);
  double* rd = device_buffer<double>(kMK);
  void* dz_split = device_buffer<char>(epifuse::split_fp16_bytes(16384, 8192));
  void* w_split = device_buffer<char>(epifuse::split_fp16_bytes(8192, 8192));
  __half* w_parts = device_buffer<__half>(2 * kNK + 2048);
  size_t ws_bytes = size_t(64) << 20;
  void* ws = device_buffer<char>(ws_bytes);
  size_t flush_bytes = size_t(256) << 20;
  void* flush = device_buffer<char>(flush_bytes);
  Bufs() { CK(cudaMemset(zeros, 0, 8192 * sizeof(float))); }
};

// dX [M, K] = dZ [M, N] . W [N, K] both ways; errors against DGEMM, then (timing) each part.
static void run_shape(Bufs& b, cublasHandle_t h, cudaStream_t s, int M, int N, int K, int spread,
                      bool timing, const char* label) {
  fill_scaled<<<1024, 256, 0, s>>>(int64_t(M) * N, b.dz, 21, 1e-3f, 0.f);
  fill_scaled<<<1024, 256, 0, s>>>(int64_t(N) * K, b.w, 22, 1.f / std::sqrt(float(N)), 0.f);
  if (spread > 0) scale_rows<<<1024, 256, 0, s>>>(N, K, b.w, spread);
  widen<<<1024, 256, 0, s>>>(int64_t(M) * N, b.dz, b.dzd);
  widen<<<1024, 256, 0, s>>>(int64_t(N) * K, b.w, b.wd);
  // Column-major, dX^T [K, M] = W^T . dZ^T: W row-major is [K, N] column-major, dZ is [N, M].
  const double one = 1, zero = 0;
  CB(cublasDgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, K, M, N, &one, b.wd, K, b.dzd, N, &zero, b.rd, K));
  const float fone = 1, fzero = 0;
  auto sgemm = [&] {
    CB(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, K, M, N, &fone, b.w, K, b.dz, N, &fzero, b.d, K));
  };
  auto error = [&] { return max_error_ratio(b.d, b.rd, int64_t(M) * K, s); };
  sgemm();
  const double e_sgemm = error();
  const int Nh = int(epifuse::split_fp16_ld(N));  // the product's split K (2 Np)
  const int64_t Np = Nh / 2;
  // Today: dZ by rows; W^T (W as a [K, N] view with ld_row 1) by the tiled path.
  auto split_dz = [&] { epifuse::split_fp16(b.dz, M, N, N, 1, b.dz_split, nullptr, s); };
  auto split_wt = [&] { epifuse::split_fp16(b.w, K, N, 1, K, b.w_split, nullptr, s); };
  auto gemm_k_major = [&] {
    const auto acc = epifuse::evt::acc_args<epifuse::evt::ScaledAccFetch<Shape<_128, _128, _64>>>(
        epifuse::split_fp16_exponents(b.dz_split, M, N), epifuse::split_fp16_exponents(b.w_split, K, N));
    KMajorB::run(static_cast<const cutlass::half_t*>(b.dz_split),
                 static_cast<const cutlass::half_t*>(b.w_split), b.d, M, K, Nh,
                 epifuse::evt::per_column_affine_args<Tree>(nullptr, nullptr, epifuse::Activation{}, acc),
                 b.ws, b.ws_bytes, s);
  };
  // Row split: W by rows as MN-major B, dZ' = dZ 2^e_w by rows, the epilogue scaled by dZ''s.
  const int64_t ldk = (K + 7) / 8 * 8;
  auto split_w_rows = [&] {
    split_rows_as_mn_major_b<<<N, 256, 0, s>>>(b.w, N, K, b.w_parts, ldk, b.e_w);
  };
  auto split_dz_scaled = [&] {
    scale_columns<<<1024, 256, 0, s>>>(M, N, b.dz, b.e_w, b.dzs);
    epifuse::split_fp16(b.dzs, M, N, N, 1, b.dz_split, nullptr, s);
  };
  auto gemm_mn_major = [&] {
    const auto acc = epifuse::evt::acc_args<epifuse::evt::ScaledAccFetch<Shape<_128, _128, _64>>>(
        epifuse::split_fp16_exponents(b.dz_split, M, N), b.zeros);
    MnMajorB::run(static_cast<const cutlass::half_t*>(b.dz_split),
                  reinterpret_cast<const cutlass::half_t*>(b.w_parts), b.d, M, K, Nh,
                  epifuse::evt::per_column_affine_args<Tree>(nullptr, nullptr, epifuse::Activation{}, acc),
                  b.ws, b.ws_bytes, s, ldk);
  };
  CK(cudaMemsetAsync(b.w_parts, 0, sizeof(__half) * size_t(2 * Np) * ldk, s));  // padded rows
  split_dz(); split_wt(); gemm_k_major();
  const double e_today = error();
  const int64_t MK = int64_t(M) * K;
  CK(cudaMemcpyAsync(b.d2, b.d, sizeof(float) * MK, cudaMemcpyDeviceToDevice, s));
  CK(cudaMemsetAsync(b.d, 0xff, sizeof(float) * MK, s));  // NaN: an output the GEMM missed shows
  split_w_rows(); split_dz_scaled(); gemm_mn_major();
  const double e_rows = error();
  printf("%-16s M=%5d N=%5d K=%5d  err/max: sgemm %.2e  W^T split %.2e (%.2fx)  W row split %.2e "
         "(%.2fx); outputs differing in bits %llu of %lld\n", label, M, N, K, e_sgemm, e_today,
         e_today / e_sgemm, e_rows, e_rows / e_sgemm, differing_bits(b.d, b.d2, MK, s),
         (long long)MK);
  if (!timing) return;
  const double flop = 2.0 * M * N * K;
  const float t_dz = best_ms(s, b.flush, b.flush_bytes, split_dz);
  const float t_wt = best_ms(s, b.flush, b.flush_bytes, split_wt);
  const float t_gk = best_ms(s, b.flush, b.flush_bytes, gemm_k_major);
  const float t_wr = best_ms(s, b.flush, b.flush_bytes, split_w_rows);
  const float t_dzs = best_ms(s, b.flush, b.flush_bytes, split_dz_scaled);
  const float t_gm = best_ms(s, b.flush, b.flush_bytes, gemm_mn_major);
  printf("  ms: W^T split: dZ %.3f + W^T %.3f + GEMM (B K-major) %.3f (%.0f TFLOP/s) = %.3f\n",
         t_dz, t_wt, t_gk, flop / t_gk * 1e-9, t_dz + t_wt + t_gk);
  printf("  ms: W row split: W %.3f + dZ' (scale and split) %.3f + GEMM (B MN-major) %.3f (%.0f TFLOP/s) = %.3f\n",
         t_wr, t_dzs, t_gm, flop / t_gm * 1e-9, t_wr + t_dzs + t_gm);
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasHandle_t h = reference_cublas_on(s);
  Bufs b;
  run_shape(b, h, s, 1024, 8192, 8192, 0, true, "p84 dX");
  run_shape(b, h, s, 16384, 4096, 4096, 0, true, "p39 dX");
  run_shape(b, h, s, 1024, 8192, 8192, 8, false, "p84 rows 2^+-8");
  for (int n : {64, 256, 1024, 4096})
    run_shape(b, h, s, 1024, n, 1024, 0, false, "sweep N");
  CK(cudaDeviceSynchronize());
  printf("done\n");
  return 0;
}
