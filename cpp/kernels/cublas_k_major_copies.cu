// Operand layout before cuBLAS's TF32 products (cublas_tf32_k_major_copies, kernels.h): which
// MN-major operand of the backward's dX = dZ . W and dW = dZ^T . X the op layer copies into K-major
// rows first (transpose.cu), and in chunks of how many rows. The shape heuristics of the products
// the op layer runs on cuBLAS; those of epifuse's own GEMMs are in gemm_plan.cu.
#include <algorithm>

#include "debug_switches.hpp"
#include "epifuse/kernels.h"
#include "operand_chunks.hpp"

namespace epifuse {
namespace {

// TF32 wgmma reads only K-major tiles, so cuBLAS multiplies MN-major fp32 operands on slower
// kernels; how much slower depends on which operand is MN-major (H200, cuBLAS 13, the backward's
// shapes; experiments/tf32_operand_layouts.cu, experiments/README.md "K-major copies for cuBLAS
// TF32"):
//   - both (dW = dZ^T . X): 1.5-1.6x the K-major product at every shape measured. One copy
//     suffices: the smaller operand's (a tie: w's), since x MN-major alone costs at most 1.08x;
//   - w alone (dX = dZ . W): 1.02x at M = 4096 rows, 1.13-1.15x from M = 8192. w is copied from
//     kWCopyMinRows rows: at 4096 x 4096 x 4096 its copy costs 47 us against 7 us saved, at
//     8192 x 4096 x 4096 it saves 48 us;
//   - x alone: 0.96-1.08x, never more than its copy would cost: not copied.
// A copy reads and writes the operand once (8 bytes per element) and pays only where that is small
// beside the product: copying x [M, K] costs 8MK bytes against 2MNK flops, so not below N = 2048
// (w [N, K]: M = 2048), which keeps small products on cuBLAS's MN-major kernels. The copy must be a
// tiled transpose (transpose.cu): Tensor::contiguous of the transposed views gained nothing.
constexpr int64_t kKMajorCopyMinOther = 2048;
constexpr int64_t kWCopyMinRows = 8192;

// A copy is the one thing the fused step holds that eager's does not: the projection MLP's TF32
// step (batch 4096) peaked at 520 MiB against eager's 456, the 64 MiB copy of its 4096 x 4096 dW's
// operand beside the product. A copy over kRefineCopyBytes is therefore halved while each chunk's
// product keeps kMinCopyChunkTiles of cuBLAS's 128x256 tiles (about two waves on 132 SMs, so the
// chunks cost no more waves than the whole: 4096 x 4096 x 4096 in two chunks of 256 tiles is 4
// waves either way). Problems 84 and 39 keep their chunks (32 MiB; 128 MiB chunks of 256 tiles).
constexpr size_t kRefineCopyBytes = size_t(32) << 20;
constexpr int64_t kMinCopyChunkTiles = 256;

int64_t refine_copy_chunk(int64_t rows, int64_t n, int64_t m, size_t row_bytes) {
  return dispatch::halve_chunk_for_memory(
      rows, row_bytes, kRefineCopyBytes,
      [&](int64_t r) { return dispatch::copy_chunk_rows(n, row_bytes, size_t(r) * row_bytes / 2); },
      [&](int64_t r) { return ((m + 127) / 128) * ((r + 255) / 256) >= kMinCopyChunkTiles; });
}

}  // namespace

// EPIFUSE_TF32_K_MAJOR_COPIES=0 (DebugSwitches::tf32_k_major_copies) turns the copies off (to
// measure them).
KMajorCopies cublas_tf32_k_major_copies(const GemmProblem& p, int cc_major, int cc_minor) {
  KMajorCopies copies;
  // 16-bit wgmma reads MN-major tiles as they are; sm80 is unmeasured.
  const bool hopper_tf32 = p.dtype == DType::kFloat32 && p.math == MathMode::kTF32 &&
                           cc_major == 9 && cc_minor == 0;
  if (!hopper_tf32 || !debug_switches().tf32_k_major_copies) return copies;
  const bool x_mn = p.x_col_stride != 1, w_mn = p.w_col_stride != 1;
  if (x_mn && w_mn) {  // copy the smaller one
    if (p.M < p.N) {
      copies.x = p.N >= kKMajorCopyMinOther;
    } else {
      copies.w = p.M >= kKMajorCopyMinOther;
    }
  }
  // w left MN-major beside a K-major x: copied for many rows only.
  if (w_mn && !copies.w && (copies.x || !x_mn) && p.M >= kWCopyMinRows) copies.w = true;
  // w's copy in chunks of its rows (copy_chunk_rows): dW's copy of x^T at problem 39's size is
  // 256 MiB, two chunks of 2048 rows (the product's output columns), each 128 x 16 of cuBLAS's
  // 128x256 tiles.
  if (copies.w) {
    const size_t row_bytes = sizeof(float) * size_t(std::max<int64_t>(p.K, 1));
    const int64_t rows = refine_copy_chunk(
        dispatch::copy_chunk_rows(p.N, row_bytes, dispatch::kWCopyChunkBytes), p.N, p.M,
        row_bytes);
    copies.w_chunk = rows < p.N ? rows : 0;
  }
  return copies;
}

}  // namespace epifuse
