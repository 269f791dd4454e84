// fp32 GEMMs at fp32 accuracy on the FP16 tensor cores: can 3 FP16 products replace 3 TF32 ones?
//
// The default-precision GEMM split each fp32 operand value v = hi + lo into two TF32 parts (11
// significant bits each) and ran three TF32 wgmma products (sm90_mainloop_3x.hpp). FP16 also keeps
// 11 significant bits, and Hopper's FP16 wgmma runs at twice the TF32 rate, but FP16's exponent
// range is 2^-24..2^15 against fp32's. Scaled by a power of two per operand row (the K extent of a
// GEMM operand: a row of x, a row of the weight), so that the row's largest |v| lands in
// [2^14, 2^15), hi = fp16(v * 2^-e) and lo = fp16(v * 2^-e - hi) carry the same 22 bits as the
// TF32 pair for every value down to 2^-18 of its row's largest (lo stays normal), and the product
// is scaled back exactly in the epilogue: D[m, n] = acc[m, n] * 2^(eA[m] + eB[n]). The mainloop is
// the same (promoted accumulation) with FP16 k-blocks: a 128-byte K-tile is 32 hi and their 32 lo
// halves.
//
// Measured here, on the library's split (split_fp16.cu, both paths: a row-major x through its row
// path, a column-major one through its tiled path, whose product must match bit for bit) and
// epilogue tree (ScaledAccFetch), against the TF32 split it replaced (kept below as the baseline):
// time of the splits and of the GEMM at problem 39's and problem 84's shapes, and the error
// against float64 (cuBLAS DGEMM) beside cuBLAS SGEMM's, for x ~ U[0, 1), x + 100, and a K sweep.
//
// Result on an H200 (experiments/README.md, "fp16x3_split.cu"): the FP16 GEMM 1.7x
// faster (problem 39: 2.35 against 4.05 ms; problem 84: 0.557 against 0.973 ms), its error 0.6-0.8x
// the TF32 parts' (0.17-0.60x SGEMM's), the split of x 0.6x as long. The library now runs it.
//
//   CL=<site-packages>/cutlass_library/source NV=<site-packages>/nvidia/cu13
//   /usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DNDEBUG \
//        --expt-relaxed-constexpr -I$CL/include -I$CL/tools/util/include -Icpp/include \
//        -Icpp/kernels -I$NV/include -L$NV/lib experiments/fp16x3_split.cu \
//        -l:libcublas.so.13 -o build/experiments/fp16x3
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <cstdio>
#include <vector>

#include "library_3x.cuh"
#include "standalone.cuh"

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;
using epifuse::GemmProblem;

// ---- the baseline: the TF32 split the FP16 one replaced (split_tf32.cu until then) -------------
// Per row, blocks of 32 floats: the 16 hi = tf32(v) parts of 16 consecutive k, then their 16 lo =
// tf32(v - hi) parts; a 32x32 tile through shared memory.
__global__ void split_tf32_kernel(const float* __restrict__ src, int64_t rows, int64_t cols,
                                  float* __restrict__ dst, int64_t dst_ld) {
  __shared__ float tile[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t r0 = int64_t(blockIdx.y) * 32, k0 = int64_t(blockIdx.x) * 32;
  for (int r = ty; r < 32; r += 8)
    tile[r][tx] = (r0 + r < rows && k0 + tx < cols) ? src[(r0 + r) * cols + k0 + tx] : 0.f;
  __syncthreads();
  const int j = tx / 16, i = tx % 16;
  if (k0 + tx >= dst_ld / 2) return;
  for (int r = ty; r < 32 && r0 + r < rows; r += 8) {
    const float v = tile[r][tx];
    uint32_t hi, lo;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(v));
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(v - __uint_as_float(hi)));
    float* out = dst + (r0 + r) * dst_ld + (k0 / 16 + j) * 32;
    out[i] = __uint_as_float(hi);
    out[16 + i] = __uint_as_float(lo);
  }
}
static int64_t tf32_ld(int64_t k) { return 2 * ((k + 15) / 16 * 16); }
static void split_tf32(const float* src, int64_t rows, int64_t cols, float* dst, cudaStream_t s) {
  const int64_t ld = tf32_ld(cols);
  split_tf32_kernel<<<dim3(unsigned(ld / 2 / 32 + (ld / 2 % 32 != 0)), unsigned((rows + 31) / 32)),
                      dim3(32, 8), 0, s>>>(src, rows, cols, dst, ld);
}

// FP16 parts through the production tree (the plain product: a = 1, c = 0) with its scaled
// accumulator; TF32 parts through the plain one.
using Fp16Tree = epifuse::evt::PerColumnAffine<Shape<_128, _128, _64>, float,
                                               epifuse::evt::ScaledAccFetch<Shape<_128, _128, _64>>>;
using Tf32Tree = epifuse::evt::PerColumnAffine<Shape<_128, _128, _32>, float>;
using Fp16x3 = SplitGemm<cutlass::half_t, _64, Fp16Tree>;
using Tf32x3 = SplitGemm<float, _32, Tf32Tree>;

// ---- fills, reference, error ---------------------------------------------------------------------
struct Bufs {
  float *x, *x_cm, *w, *d, *d2, *xs_tf32, *ws_tf32;
  void *xs, *ws_split;
  double *xd, *wd, *rd;
  void* ws;
  size_t ws_bytes = size_t(64) << 20;
  void* flush;
  size_t flush_bytes = size_t(256) << 20;
};


__global__ void transpose_f32(int64_t rows, int64_t cols, const float* a, float* t) {  // t = a^T
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x)
    t[(i % cols) * rows + i / cols] = a[i];
}

// One shape: times (split x, split w, GEMM) for both schemes and SGEMM; errors vs DGEMM.
static void run_shape(Bufs& b, cublasHandle_t h, cudaStream_t s, int M, int N, int K, float xmul,
                      float xadd, bool timing, const char* label) {
  const float wmul = 1.f / std::sqrt(float(K));
  fill_scaled<<<1024, 256, 0, s>>>(int64_t(M) * K, b.x, 11, 0.5f * xmul, 0.5f * xmul + xadd);
  fill_scaled<<<1024, 256, 0, s>>>(int64_t(N) * K, b.w, 12, wmul, 0.f);
  widen<<<1024, 256, 0, s>>>(int64_t(M) * K, b.x, b.xd);
  widen<<<1024, 256, 0, s>>>(int64_t(N) * K, b.w, b.wd);
  transpose_f32<<<1024, 256, 0, s>>>(M, K, b.x, b.x_cm);  // x column-major: [K, M]
  const double one = 1, zero = 0;
  // row-major R[M, N] = x . w^T  <=>  column-major R^T = w^T(op T of [K, N]) ... as cuBLAS sees it
  CB(cublasDgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, b.wd, K, b.xd, K, &zero, b.rd, N));
  auto error = [&]() { return max_error_ratio(b.d, b.rd, int64_t(M) * N, s); };
  const float fone = 1, fzero = 0;
  auto sgemm = [&] {
    CB(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &fone, b.w, K, b.x, K, &fzero, b.d, N));
  };
  sgemm();
  const double e_sgemm = error();
  const int Kh = int(epifuse::split_fp16_ld(K)), Kt = int(tf32_ld(K));
  // The production split: rows along K (x row-major, w), or tiled (x column-major).
  auto fp16_split_x = [&] { epifuse::split_fp16(b.x, M, K, K, 1, b.xs, nullptr, s); };
  auto fp16_split_x_cm = [&] { epifuse::split_fp16(b.x_cm, M, K, 1, M, b.xs, nullptr, s); };
  auto fp16_split_w = [&] { epifuse::split_fp16(b.w, N, K, K, 1, b.ws_split, nullptr, s); };
  auto fp16_gemm = [&] {
    const auto acc = epifuse::evt::acc_args<epifuse::evt::ScaledAccFetch<Shape<_128, _128, _64>>>(
        epifuse::split_fp16_exponents(b.xs, M, K), epifuse::split_fp16_exponents(b.ws_split, N, K));
    Fp16x3::run(static_cast<const cutlass::half_t*>(b.xs),
                static_cast<const cutlass::half_t*>(b.ws_split), b.d, M, N, Kh,
                epifuse::evt::per_column_affine_args<Fp16Tree>(nullptr, nullptr, epifuse::Activation{}, acc),
                b.ws, b.ws_bytes, s);
  };
  auto tf32_split_x = [&] { split_tf32(b.x, M, K, b.xs_tf32, s); };
  auto tf32_split_w = [&] { split_tf32(b.w, N, K, b.ws_tf32, s); };
  auto tf32_gemm = [&] {
    Tf32x3::run(b.xs_tf32, b.ws_tf32, b.d, M, N, Kt,
                epifuse::evt::per_column_affine_args<Tf32Tree>(nullptr, nullptr, epifuse::Activation{},
                                                               cutlass::epilogue::fusion::Sm90AccFetch::Arguments{}),
                b.ws, b.ws_bytes, s);
  };
  // The tiled path's product must be the row path's, bit for bit.
  fp16_split_x_cm(); fp16_split_w(); fp16_gemm();
  CK(cudaMemcpyAsync(b.d2, b.d, sizeof(float) * size_t(M) * N, cudaMemcpyDeviceToDevice, s));
  double e16[2], e32;
  for (int p = 1; p <= 2; ++p) {
    epifuse::sm90::g_promotion_interval = p;
    fp16_split_x(); fp16_split_w(); fp16_gemm();
    e16[p - 1] = error();
  }
  epifuse::sm90::g_promotion_interval = 1;
  tf32_split_x(); tf32_split_w(); tf32_gemm();
  e32 = error();
  fp16_split_x(); fp16_split_w(); fp16_gemm();
  const bool same = differing_bits(b.d, b.d2, int64_t(M) * N, s) == 0;
  printf("%-10s M=%5d N=%5d K=%5d  err/max: sgemm %.2e  3xtf32 %.2e (%.2fx)  3xfp16 p1 %.2e (%.2fx) p2 %.2e (%.2fx)%s\n",
         label, M, N, K, e_sgemm, e32, e32 / e_sgemm, e16[0], e16[0] / e_sgemm, e16[1], e16[1] / e_sgemm,
         same ? "" : "  TILED PATH DIFFERS");
  if (!timing) return;
  const double flop = 2.0 * M * N * K;
  const float t_sg = best_ms(s, b.flush, b.flush_bytes, sgemm);
  const float t_tx = best_ms(s, b.flush, b.flush_bytes, tf32_split_x);
  const float t_tw = best_ms(s, b.flush, b.flush_bytes, tf32_split_w);
  const float t_tg = best_ms(s, b.flush, b.flush_bytes, tf32_gemm);
  const float t_hx = best_ms(s, b.flush, b.flush_bytes, fp16_split_x);
  const float t_hw = best_ms(s, b.flush, b.flush_bytes, fp16_split_w);
  const float t_hxc = best_ms(s, b.flush, b.flush_bytes, fp16_split_x_cm);
  const float t_hg = best_ms(s, b.flush, b.flush_bytes, fp16_gemm);
  epifuse::sm90::g_promotion_interval = 2;
  const float t_hg2 = best_ms(s, b.flush, b.flush_bytes, fp16_gemm);
  epifuse::sm90::g_promotion_interval = 1;
  printf("  ms: sgemm %.3f | 3xtf32 split x %.3f w %.3f gemm %.3f (%.0f TFLOP/s) | 3xfp16 split x %.3f "
         "(column-major x: %.3f) w %.3f gemm %.3f (%.0f TFLOP/s), promotion 2: %.3f\n",
         t_sg, t_tx, t_tw, t_tg, flop / t_tg * 1e-9, t_hx, t_hxc, t_hw, t_hg, flop / t_hg * 1e-9, t_hg2);
  // The same GEMMs back to back for a second each: the clock the power cap leaves them.
  const float u_sg = sustained_ms(s, sgemm), u_hg = sustained_ms(s, fp16_gemm);
  epifuse::sm90::g_promotion_interval = 2;
  const float u_hg2 = sustained_ms(s, fp16_gemm);
  epifuse::sm90::g_promotion_interval = 1;
  printf("  sustained ms: sgemm %.3f | 3xfp16 gemm %.3f (%.0f TFLOP/s), promotion 2: %.3f (%.0f TFLOP/s)\n",
         u_sg, u_hg, flop / u_hg * 1e-9, u_hg2, flop / u_hg2 * 1e-9);
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasHandle_t h = reference_cublas_on(s);
  Bufs b;
  const size_t maxMK = size_t(16384) * 8192, maxNK = size_t(8192) * 8192, maxMN = size_t(16384) * 8192;
  CK(cudaMalloc(&b.x, maxMK * 4));
  CK(cudaMalloc(&b.x_cm, maxMK * 4));
  CK(cudaMalloc(&b.w, maxNK * 4));
  CK(cudaMalloc(&b.d, maxMN * 4));
  CK(cudaMalloc(&b.d2, maxMN * 4));
  CK(cudaMalloc(&b.xs_tf32, maxMK * 8 + 4096));
  CK(cudaMalloc(&b.ws_tf32, maxNK * 8 + 4096));
  CK(cudaMalloc(&b.xs, epifuse::split_fp16_bytes(16384, 8192)));
  CK(cudaMalloc(&b.ws_split, epifuse::split_fp16_bytes(8192, 8192)));
  CK(cudaMalloc(&b.xd, maxMK * 8));
  CK(cudaMalloc(&b.wd, maxNK * 8));
  CK(cudaMalloc(&b.rd, maxMN * 8));
  CK(cudaMalloc(&b.ws, b.ws_bytes));
  CK(cudaMalloc(&b.flush, b.flush_bytes));
  run_shape(b, h, s, 16384, 4096, 4096, 1.f, 0.f, true, "p39");
  run_shape(b, h, s, 1024, 8192, 8192, 1.f, 0.f, true, "p84");
  run_shape(b, h, s, 4096, 4096, 4096, 1.f, 0.f, true, "4k");
  run_shape(b, h, s, 1024, 8192, 8192, 1.f, 100.f, false, "p84 x+100");
  for (int K : {64, 128, 256, 1024, 4096, 8192})
    run_shape(b, h, s, 1024, 1024, K, 1.f, 0.f, false, "sweep");
  for (int K : {64, 1024, 8192})
    run_shape(b, h, s, 1024, 1024, K, 1e-3f, 0.f, false, "x*1e-3");
  for (int K : {256, 4096})
    run_shape(b, h, s, 1024, 1024, K, 2.f, -1.f, false, "x~U[-1,1)");
  CK(cudaDeviceSynchronize());
  printf("done\n");
  return 0;
}
