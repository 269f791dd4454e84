// TF32 GEMMs on MN-major operands: can the backward's K-major copies go?
//
// A training step's backward in TF32 multiplies transposed views: dX = dZ . W reads W [N, K]
// along its rows (B MN-major), dW = dZ^T . X reads both dZ and X MN-major. wgmma reads 32-bit
// operands from shared memory K-major only, and cuBLAS's TF32 kernels for MN-major operands run
// at ~60% of the K-major rate on an H100/H200 (experiments/README.md, "K-major copies for cuBLAS
// TF32"),
// so epifuse copies such operands K-major first (transpose.cu): 8 copies, ~286 us of the
// projection MLP's ~2.3 ms TF32 step. CUTLASS 4.2's RS mainloop takes every layout: an MN-major A
// goes shared memory -> registers transposed (wgmma with A from registers), a K-major A with an
// MN-major B swaps the operands (SwapAB), and with both MN-major B is transposed in shared memory
// by the consumers (TransposeB). Here each layout runs on that CUTLASS kernel and on cuBLAS
// (CUBLAS_COMPUTE_32F_FAST_TF32) beside the K-major SS kernel, at the backward's shapes.
//
//   CL=<site-packages>/cutlass_library/source
//   /usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DNDEBUG \
//        --expt-relaxed-constexpr -I$CL/include -I$CL/tools/util/include \
//        experiments/tf32_operand_layouts.cu -lcublas -o build/experiments/tf32_layouts
//   (a toolkit without cuBLAS: the pip wheel's, NV=<site-packages>/nvidia/cu13,
//    -I$NV/include -L$NV/lib -l:libcublas.so.13 and LD_LIBRARY_PATH=$NV/lib to run it)
//   build/experiments/tf32_layouts [M N K ...]   (triples; default: the projection MLP's and
//                                                 problem 39's backward shapes)
//
// D[M, N] (fp32, row-major) = A[M, K] . B[K, N]; "A K" means A's K index is contiguous (row-major
// [M, K]), "A M" its M index (stored [K, M]); "B K": stored [N, K]; "B N": stored [K, N]. The
// layouts of the backward: dX = dZ . W is (A K, B N); dW = dZ^T . X is (A M, B N); after
// epifuse's copies both are (A K, B K). Timing: best of 20 CUDA-event timings, 3 warm-ups, a
// 256 MiB memset between calls (L2 flushed). Each CUTLASS result is checked against cuBLAS's on
// the same operands (max |difference| / max |cuBLAS|: both round to TF32, differently).
//
// Result on an H200 (experiments/README.md, "tf32_operand_layouts.cu"): both operands MN-major cost
// 1.5-1.6x the K-major product on either library, B MN-major alone 1.02x at 4096 rows and
// 1.13-1.15x from 8192, A MN-major alone at most 1.08x; the RS kernels beat cuBLAS only on
// layouts and shapes the backward does not run after its copies. gemm_plan.cu's
// cublas_tf32_k_major_copies follows from it. The SwapAB rows (A K,
// B N) differ from cuBLAS's product (diff ~1.4): that form is not a valid product as configured
// here, and its times were not used.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"
#include "standalone.cuh"

using namespace cute;

// CUTLASS's layout tags: A is M x K (RowMajor: K-major), B is K x N (ColumnMajor: K-major).
using AK = cutlass::layout::RowMajor;
using AM = cutlass::layout::ColumnMajor;
using BK = cutlass::layout::ColumnMajor;
using BN = cutlass::layout::RowMajor;

// TileShape a parameter so that the builders' types stay dependent until instantiation (nvcc
// 13.0's host pass fails on them at namespace scope).
template <class LayoutA, class LayoutB, class TileShape_ = Shape<_128, _256, _32>,
          class ClusterShape_ = Shape<_2, _1, _1>,
          class Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative,
          class EpiSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative>
struct Tf32Gemm {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, 4,  // no C operand (beta = 0)
      float, cutlass::layout::RowMajor, 4, EpiSchedule>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      float, LayoutA, 4, float, LayoutB, 4, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kStages = CollectiveMainloop::DispatchPolicy::Stages;
  static constexpr bool kAK = std::is_same_v<LayoutA, AK>, kBK = std::is_same_v<LayoutB, BK>;
};

template <class Cfg>
struct Runner {
  typename Cfg::Gemm gemm;
  void* workspace = nullptr;
  bool ok = false;
  char name[64];

  void init(const char* n, const float* A, const float* B, float* D, int M, int N, int K, int device,
            int sms) {
    snprintf(name, sizeof(name), "%s", n);
    using Kn = typename Cfg::Kernel;
    auto sa = cutlass::make_cute_packed_stride(typename Kn::StrideA{}, make_shape(M, K, 1));
    auto sb = cutlass::make_cute_packed_stride(typename Kn::StrideB{}, make_shape(N, K, 1));
    auto sd = cutlass::make_cute_packed_stride(typename Kn::StrideD{}, make_shape(M, N, 1));
    typename Cfg::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                       {M, N, K, 1},
                                       {A, sa, B, sb},
                                       {{}, nullptr, typename Kn::StrideC{}, D, sd},
                                       cutlass::KernelHardwareInfo{device, sms}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    cutlass::Status st = Cfg::Gemm::can_implement(args);
    if (st != cutlass::Status::kSuccess) {
      printf("  %-28s cannot run: %s\n", name, cutlassGetStatusString(st));
      return;
    }
    const size_t ws = Cfg::Gemm::get_workspace_size(args);
    if (workspace) {
      CK(cudaFree(workspace));
      workspace = nullptr;
    }
    if (ws) CK(cudaMalloc(&workspace, ws));
    st = gemm.initialize(args, workspace);
    if (st != cutlass::Status::kSuccess) {
      printf("  %-28s cannot initialize: %s\n", name, cutlassGetStatusString(st));
      return;
    }
    ok = true;
  }
  void run(cudaStream_t s) {
    if (gemm.run(s) != cutlass::Status::kSuccess) {
      fprintf(stderr, "%s: run failed (%s)\n", name, cudaGetErrorString(cudaGetLastError()));
      exit(1);
    }
  }
};

// cuBLAS on the same operands: row-major D = A . B is column-major D^T = B^T . A^T.
void cublas_tf32(cublasHandle_t h, bool a_k, bool b_k, int M, int N, int K, const float* A,
                 const float* B, float* D) {
  const float one = 1.0f, zero = 0.0f;
  // B^T (N x K col-major): stored [K, N] (B N) is that with ld N; stored [N, K] (B K) is its transpose.
  const cublasOperation_t opB = b_k ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int ldb = b_k ? K : N;
  // A^T (K x M col-major): stored [M, K] (A K) is that with ld K; stored [K, M] (A M) its transpose.
  const cublasOperation_t opA = a_k ? CUBLAS_OP_N : CUBLAS_OP_T;
  const int lda = a_k ? K : M;
  CB(cublasGemmEx(h, opB, opA, N, M, K, &one, B, CUDA_R_32F, ldb, A, CUDA_R_32F, lda, &zero, D,
                  CUDA_R_32F, N, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
}

double rel_diff(const float* x, const float* ref, int64_t n) {
  std::vector<float> a(n), b(n);
  CK(cudaMemcpy(a.data(), x, n * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b.data(), ref, n * 4, cudaMemcpyDeviceToHost));
  double md = 0, mr = 0;
  for (int64_t i = 0; i < n; ++i) {
    md = std::max(md, double(std::fabs(a[i] - b[i])));
    mr = std::max(mr, double(std::fabs(b[i])));
  }
  return md / std::max(mr, 1e-30);
}

struct Ctx {
  int M, N, K, device, sms;
  float *A, *B, *D, *Dref;
  void* flush;
  size_t flush_bytes;
  cudaStream_t s;
  cublasHandle_t h;
};

template <class Cfg>
void measure(Ctx& c, const char* name) {
  static Runner<Cfg> r;  // one per configuration: its workspace kept across shapes
  r.ok = false;
  r.init(name, c.A, c.B, c.D, c.M, c.N, c.K, c.device, c.sms);
  if (!r.ok) return;
  const double flop = 2.0 * c.M * c.N * double(c.K);
  const float t_cutlass = best_ms(c.s, c.flush, c.flush_bytes, [&] { r.run(c.s); });
  const float t_cublas = best_ms(c.s, c.flush, c.flush_bytes, [&] {
    cublas_tf32(c.h, Cfg::kAK, Cfg::kBK, c.M, c.N, c.K, c.A, c.B, c.Dref);
  });
  CK(cudaStreamSynchronize(c.s));
  const double err = rel_diff(c.D, c.Dref, int64_t(c.M) * c.N);
  printf("  %-30s A %s, B %s  %2d stages  CUTLASS %8.4f ms (%5.0f TFLOP/s)  cuBLAS %8.4f ms (%5.0f)"
         "  diff %.1e\n",
         name, Cfg::kAK ? "K" : "M", Cfg::kBK ? "K" : "N", Cfg::kStages, t_cutlass,
         flop / t_cutlass * 1e-9, t_cublas, flop / t_cublas * 1e-9, err);
}

using T128x256 = Shape<_128, _256, _32>;
using T128x128 = Shape<_128, _128, _32>;
using C2x1 = Shape<_2, _1, _1>;
using C1x2 = Shape<_1, _2, _1>;

int main(int argc, char** argv) {
  std::vector<int> shapes;
  for (int i = 1; i < argc; ++i) shapes.push_back(atoi(argv[i]));
  if (shapes.empty()) {
    // projection MLP (batch 4096): layer 2's dX / dW, layer 1's dX / dW; problem 39's dX / dW
    shapes = {4096, 4096, 4096, 4096, 4096, 4096, 4096, 2048, 4096, 4096, 2048, 4096,
              8192, 4096, 4096, 16384, 4096, 4096, 4096, 4096, 16384};
  }
  if (shapes.size() % 3) { fprintf(stderr, "usage: %s [M N K]...\n", argv[0]); return 2; }
  Ctx c{};
  CK(cudaGetDevice(&c.device));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, c.device));
  c.sms = prop.multiProcessorCount;
  printf("%s, %d SMs\n", prop.name, c.sms);
  if (prop.major != 9) { fprintf(stderr, "needs an sm_90 GPU\n"); return 1; }
  size_t most = 0;
  for (size_t i = 0; i < shapes.size(); i += 3) {
    most = std::max({most, size_t(shapes[i]) * shapes[i + 2], size_t(shapes[i + 1]) * shapes[i + 2],
                     size_t(shapes[i]) * shapes[i + 1]});
  }
  CK(cudaMalloc(&c.A, most * 4)); CK(cudaMalloc(&c.B, most * 4));
  CK(cudaMalloc(&c.D, most * 4)); CK(cudaMalloc(&c.Dref, most * 4));
  c.flush_bytes = size_t(256) << 20;
  CK(cudaMalloc(&c.flush, c.flush_bytes));
  CK(cudaStreamCreate(&c.s));
  c.h = cublas_on(c.s);
  fill_f32<<<c.sms * 8, 256, 0, c.s>>>(int64_t(most), c.A, 1);
  fill_f32<<<c.sms * 8, 256, 0, c.s>>>(int64_t(most), c.B, 2);
  CK(cudaGetLastError());
  for (size_t i = 0; i < shapes.size(); i += 3) {
    c.M = shapes[i], c.N = shapes[i + 1], c.K = shapes[i + 2];
    printf("M %d N %d K %d\n", c.M, c.N, c.K);
    measure<Tf32Gemm<AK, BK>>(c, "SS 128x256 2x1");
    measure<Tf32Gemm<AK, BN>>(c, "SwapAB 128x256 2x1 (dX)");
    measure<Tf32Gemm<AK, BN, T128x256, C1x2>>(c, "SwapAB 128x256 1x2 (dX)");
    measure<Tf32Gemm<AK, BN, T128x128, C2x1>>(c, "SwapAB 128x128 2x1 (dX)");
    measure<Tf32Gemm<AM, BK>>(c, "RS A^T 128x256 2x1");
    measure<Tf32Gemm<AM, BN>>(c, "RS A^T+TransposeB 128x256 (dW)");
    measure<Tf32Gemm<AM, BN, T128x128, C2x1>>(c, "RS A^T+TransposeB 128x128 (dW)");
    fflush(stdout);
  }
  return 0;
}
