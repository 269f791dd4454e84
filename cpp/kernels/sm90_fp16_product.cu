// The backward's fp16 GEMMs under autocast whose result is fp32 (dW of fp32 parameters, dX of an
// fp32 input), as one Hopper GEMM (TMA + wgmma, warp-specialized cooperative, persistent):
//   out[m, n] = Fp16Overflow(sum_k a[m, k] * b[k, n]),  fp16 operands, fp32 accumulation and output.
// Fp16Overflow turns every value whose magnitude rounds past fp16's largest into +-inf, the value
// eager's fp16 product holds there (fp16_overflow.cu states the rule), so GradScaler skips eager's
// steps; every other value keeps fp32 precision. cuBLAS writes the fp32 product and a separate pass
// then re-reads all of it (problem 84's dW: 256 MiB, ~98 us of a 1.0 ms training step on an H100);
// here the rule costs a compare per element in the epilogue.
//
// a is [M, K] row-major (K-major: dX = dz . W) or column-major (M-major: dW = dz^T . x, a view of
// dz); b is [K, N] row-major (N-major: W, x). 16-bit wgmma reads either major-ness from shared
// memory, so neither operand is copied. The tile is the forward's 128x256 "Wide" tile with 2x1
// clusters (sm90_gemm_configs.hpp says why), the shape cuBLAS picks for these products too.
#include <climits>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cutlass/half.h"

#include "sm90_gemm.cuh"

namespace epifuse {
namespace sm90 {
namespace {

constexpr float kFp16Overflow = 65520.0f;  // the smallest magnitude fp16 rounds to inf

// +-inf where |v| rounds past fp16's largest (NaN stays NaN), v elsewhere.
template <class Fragment>
struct Fp16Overflow {
  CUTLASS_DEVICE Fragment operator()(Fragment const& x) const {
    Fragment y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < Fragment::kElements; ++i) {
      y[i] = fabsf(x[i]) >= kFp16Overflow ? copysignf(__int_as_float(0x7f800000), x[i]) : x[i];
    }
    return y;
  }
};

// D = Fp16Overflow(acc), stored in fp32.
using Fp16OverflowTree = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<Fp16Overflow, float, float, evt::kRound>,
    cutlass::epilogue::fusion::Sm90AccFetch>;

// TileShape is a parameter (with its one value) so that the builders' types stay dependent until
// instantiation: built eagerly at namespace scope, the epilogue builder fails to compile (nvcc
// 13.0's host pass with gcc: "type/value mismatch" inside CUTLASS's Sm90TmaBuilderImpl).
template <class LayoutA, class TileShape_ = Shape<_128, _256, _64>>
struct Fp16ProductKernel {
  using TileShape = TileShape_;
  using ClusterShape = Shape<_2, _1, _1>;
  using Element = cutlass::half_t;
  static constexpr int kAlignIn = 8;   // 16 bytes of fp16
  static constexpr int kAlignOut = 4;  // 16 bytes of fp32

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, kAlignOut,  // no C operand
      float, cutlass::layout::RowMajor, kAlignOut,
      cutlass::epilogue::TmaWarpSpecializedCooperative, Fp16OverflowTree>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA, kAlignIn,                    // a: [M, K], K- or M-major
      Element, cutlass::layout::RowMajor, kAlignIn,  // b: [K, N], N-major
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Gemm::Arguments;

  static Arguments arguments(const Fp16Product& p, int device, int sm_count) {
    typename Kernel::StrideA stride_a;
    if constexpr (std::is_same_v<LayoutA, cutlass::layout::RowMajor>) {
      stride_a = make_stride(p.a_stride_m, Int<1>{}, int64_t(0));
    } else {
      stride_a = make_stride(Int<1>{}, p.a_stride_k, int64_t(0));
    }
    const typename Kernel::StrideB stride_b = make_stride(Int<1>{}, p.ldb, int64_t(0));
    const typename Kernel::StrideD stride_out = make_stride(p.ldo, Int<1>{}, int64_t(0));
    return Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                     {int(p.M), int(p.N), int(p.K), 1},
                     {static_cast<const Element*>(p.a), stride_a,
                      static_cast<const Element*>(p.b), stride_b},
                     {{{}, {}}, nullptr, typename Kernel::StrideC{}, p.out, stride_out},
                     cutlass::KernelHardwareInfo{device, sm_count}};
  }
};

// Calls fn with the kernel for a's major-ness.
template <class Fn>
decltype(auto) with_layout(const Fp16Product& p, Fn&& fn) {
  if (p.a_stride_k == 1) return fn(Fp16ProductKernel<cutlass::layout::RowMajor>{});
  return fn(Fp16ProductKernel<cutlass::layout::ColumnMajor>{});
}

}  // namespace

bool fp16_product_can_implement(const Fp16Product& p, int device, int sm_count) {
  if (p.M <= 0 || p.N <= 0 || p.K <= 0 || p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX)
    return false;
  // TMA: 16-byte aligned rows (CUTLASS's can_implement checks the extents, not the strides).
  const bool a_k_major = p.a_stride_k == 1;
  if (!a_k_major && p.a_stride_m != 1) return false;
  const int64_t a_rows = a_k_major ? p.a_stride_m : p.a_stride_k;
  const int64_t a_extent = a_k_major ? p.K : p.M;
  if (a_rows % 8 || a_extent % 8 || p.ldb % 8 || p.N % 8 || p.ldo % 4) return false;
  return with_layout(p, [&](auto k) {
    using K = decltype(k);
    return K::Gemm::can_implement(K::arguments(p, device, sm_count)) == cutlass::Status::kSuccess;
  });
}

size_t fp16_product_workspace_bytes(const Fp16Product& p, int device, int sm_count) {
  return with_layout(p, [&](auto k) {
    using K = decltype(k);
    return K::Gemm::get_workspace_size(K::arguments(p, device, sm_count));
  });
}

void run_fp16_product(const Fp16Product& p, void* workspace, int device, int sm_count,
                      cudaStream_t stream) {
  with_layout(p, [&](auto k) {
    using K = decltype(k);
    const cutlass::Status status = launch_kernel<typename K::Kernel>(
        K::arguments(p, device, sm_count), workspace, device, stream);
    if (status != cutlass::Status::kSuccess)
      throw std::runtime_error(std::string("epifuse: the fp16 product GEMM failed: ") +
                               cutlassGetStatusString(status) + " (" +
                               cudaGetErrorString(cudaGetLastError()) + ")");
  });
}

}  // namespace sm90
}  // namespace epifuse
