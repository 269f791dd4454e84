// Chooses the kernel sequence for a GEMM + epilogue problem. The only place with shape heuristics.
//
//   Hopper (sm_90), 3xTF32 math (fp32 accuracy), 16-byte aligned output rows: the operands split
//                    into row-scaled FP16 hi/lo parts (split_fp16.cu; the weight's split may come
//                    cached), then the same GEMMs with the 3x mainloop (sm90_mainloop_3x.hpp) on
//                    FP16 wgmma, 128x128 tiles, the epilogue reading the product scaled back.
//   Hopper (sm_90), TF32 or 16-bit math, 16-byte aligned rows (K, N, leading dimensions and base
//   pointers):       one CUTLASS sm90 GEMM (TMA + wgmma) with the epilogue fused (epilogues.hpp);
//                    eval as z = x . w^T, training as z^T = w . x^T (per-column statistics become
//                    per-row reductions of the tile); stream-K when the output tiles cannot fill the
//                    SMs; batches of <= 384 rows transposed with narrow tiles (small_batch).
//   sm_80 and later otherwise (A100, Ada, or Hopper when EPIFUSE_FORCE_SM80=1), same alignment:
//                    one CUTLASS 2.x GEMM (cp.async + mma.sync) with the
//                    epilogue fused (sm80_epilogues.hpp); its stream-K schedule sizes itself.
//   IEEE fp32, and the 3x mode with few rows (the GEMM is bound by reading the weight, and the split
//   would read it once more): cuBLAS's SGEMM, run by the op layer (GemmPlan::host_sgemm), then
//                    the epilogue as a separate pass.
//   Anything else (ragged alignment, or IEEE without the op layer): the portable SIMT GEMM writing
//                    z, then the epilogue as a separate pass (column_stats.cu / column_affine.cu).
//
// gemm_plan makes every one of these decisions, once per GEMM, into a GemmPlan (kernels.h); the
// workspace query and the launch only read it. The kernels it picks from are the rows of the
// generated sm90_gemm_kernels.hpp / sm80_gemm_kernels.hpp (generate_kernels.py).
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda_utils.cuh"
#include "fallback.hpp"
#include "nonfinite_rows.hpp"
#include "sm80_gemm_kernels.hpp"
#include "split_fp16.hpp"
#if EPIFUSE_HAVE_SM90
#include "sm90_gemm_kernels.hpp"
#endif

#ifndef EPIFUSE_BUILT_ARCHS
#error "EPIFUSE_BUILT_ARCHS must name the compiled architectures (CMakeLists.txt defines it)"
#endif

namespace epifuse {
namespace {

// What both tensor-core paths need: 16-byte aligned rows for TMA / cp.async, and int32 extents.
// The epilogue's side: output rows and per-column vectors.
bool output_aligned(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops) {
  const int64_t align = p.dtype == DType::kFloat32 ? 4 : 8;  // elements per 16 bytes
  if (p.N % align || p.ldo % align || !is_aligned16(p.out)) return false;
  if (p.M > INT_MAX || p.N > INT_MAX) return false;
  // The epilogue's per-column vectors are read / written as 16-byte vectors.
  if (e == Epilogue::kAffine && !(is_aligned16(ops.a) && is_aligned16(ops.c))) return false;
  if (e == Epilogue::kColumnStats && !(is_aligned16(ops.colsum) && is_aligned16(ops.colsumsq)))
    return false;
  return true;
}

// Whether an operand's rows are what the tensor-core kernels read: unit column stride, 16-byte
// aligned rows.
bool rows_aligned(const void* ptr, int64_t ld, int64_t col_stride, int64_t align) {
  return col_stride == 1 && ld % align == 0 && is_aligned16(ptr);
}

// The input side. An operand the plan copies (`copies`) is read from the copy, a fresh row-major
// allocation (row stride K, 16-byte aligned: kernels.h, GemmPlan::copies), so only K counts for it.
bool vector_aligned(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops,
                    KMajorCopies copies) {
  const int64_t align = p.dtype == DType::kFloat32 ? 4 : 8;  // elements per 16 bytes
  if (p.K % align || p.K > INT_MAX) return false;
  if (!copies.x && !rows_aligned(p.x, p.ldx, p.x_col_stride, align)) return false;
  if (!copies.w && !rows_aligned(p.w, p.ldw, p.w_col_stride, align)) return false;
  return output_aligned(p, e, ops);
}

// Operands without rows of unit column stride (e.g. transposed views), which every plan but the
// split one reads only through a K-major copy.
KMajorCopies unit_stride_copies(const GemmProblem& p) {
  const int64_t k = std::max<int64_t>(p.K, 1);
  KMajorCopies copies;
  copies.x = !(p.x_col_stride == 1 && p.ldx >= k);
  copies.w = !(p.w_col_stride == 1 && p.ldw >= k);
  return copies;
}

// The math a kernel row is keyed by: 16-bit inputs multiply natively whatever p.math says.
MathMode kernel_math(const GemmProblem& p) {
  return p.dtype == DType::kFloat32 ? p.math : MathMode::kNative;
}

// EPIFUSE_FORCE_SM80=1 runs the sm80 kernels on Hopper too (to test them there); read once.
bool force_sm80() {
  static const bool forced = [] {
    const char* v = std::getenv("EPIFUSE_FORCE_SM80");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return forced;
}

// Where the 3x GEMM (MathMode::k3xTF32) gives way to cuBLAS's SGEMM (both fp32-accurate); the measurements behind the
// three thresholds are in BENCHMARKS.md, "Kernel selection":
//  - below kSplitMinRows rows the GEMM is bound by reading the weight, which the split makes a
//    second pass over; SGEMM reads it once.
//  - at small K, the 3x GEMM's error is not clearly below SGEMM's (it drops lo*lo, ~2^-22 per product,
//    while SGEMM's own error grows with K); kSplitMinK keeps a margin.
//  - below kSplitMinMacs multiply-adds the split, the row flags and the repair pass (three more
//    launches) cost more host time than SGEMM's whole run.
constexpr int64_t kSplitMinRows = 64;
constexpr int64_t kSplitMinK = 64;
constexpr double kSplitMinMacs = double(1 << 30);

bool split_pays(const GemmProblem& p) {
  return p.M >= kSplitMinRows && p.K >= kSplitMinK &&
         double(p.M) * double(p.N) * double(p.K) >= kSplitMinMacs;
}

// The kind of plan. Every kind but kEmpty and the split reads x and w through the copies
// unit_stride_copies asks for, so the alignment is that of the copies.
GemmKernelKind choose_kind(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops,
                           int cc_major, int cc_minor) {
  if (p.M == 0 || p.N == 0) return GemmKernelKind::kEmpty;
  if (cc_major < 8 || p.K == 0) return GemmKernelKind::kPortable;
  if (p.dtype == DType::kFloat32 &&
      (p.math == MathMode::kIEEE || (p.math == MathMode::k3xTF32 && !split_pays(p))))
    return GemmKernelKind::kHostSgemm;
  const bool wgmma = EPIFUSE_HAVE_SM90 && cc_major == 9 && cc_minor == 0 && !force_sm80();
  // The split copies the operands into an aligned layout, so only the output side must be aligned.
  if (wgmma && p.dtype == DType::kFloat32 && p.math == MathMode::k3xTF32 &&
      output_aligned(p, e, ops) && split_fp16_ld(p.K) <= INT_MAX)
    return GemmKernelKind::kSm90Split3x;
  if (!vector_aligned(p, e, ops, unit_stride_copies(p))) return GemmKernelKind::kPortable;
  // fp32 3xTF32 here runs the sm80 kernel: no wgmma, or a split too wide for int32 extents.
  if (p.dtype == DType::kFloat32 && p.math == MathMode::k3xTF32) return GemmKernelKind::kSm80;
  return wgmma ? GemmKernelKind::kSm90 : GemmKernelKind::kSm80;
}

// Copies of an operand that a product reads instead of the operand itself (the 3x split, a
// K-major copy for cuBLAS) are made a chunk of rows at a time, one GEMM per chunk, so that the copy
// of a large operand never exists whole (the split of problem 84's 8192x8192 weight is 256 MiB,
// that of problem 39's dZ^T for dW 256 MiB, its K-major copy of X^T in TF32 256 MiB).
// w's rows are the output's columns: at most 128 MiB of its copy at a time. x's rows (the output's
// rows, chunked only for the affine epilogue, whose rows are independent) get twice that, since
// every chunk of x re-reads every chunk of w: fewer re-splits of w. These keep the training steps'
// peaks within ~1.1x eager's while a chunk stays about one wave of tiles or more (problem 84's
// weight: four chunks of 2048 rows, 128 tiles each at M = 1024); measured: BENCHMARKS.md, "Kernel
// selection".
constexpr size_t kWCopyChunkBytes = size_t(128) << 20;
constexpr size_t kXCopyChunkBytes = size_t(256) << 20;

// Rows per chunk of an n-row operand copy of row_bytes a row within `budget` bytes: as few chunks
// as fit, of (nearly) equal sizes, a multiple of 256 rows (two 128-row tiles; column offsets stay
// 16-byte aligned); n when one chunk holds all.
int64_t copy_chunk_rows(int64_t n, size_t row_bytes, size_t budget) {
  const int64_t most = std::max<int64_t>(
      int64_t(budget / std::max<size_t>(row_bytes, 1)) / 256 * 256, 256);
  if (n <= most) return n;
  const int64_t chunks = (n + most - 1) / most;
  return ((n + chunks - 1) / chunks + 255) / 256 * 256;
}

#if EPIFUSE_HAVE_SM90
}  // namespace

// Declared in sm90_gemm.cuh; read once.
uint32_t sm90::split3x_promotion_interval() {
  static const uint32_t interval = [] {
    const char* v = std::getenv("EPIFUSE_3X_PROMOTION");
    const long n = v != nullptr ? std::strtol(v, nullptr, 10) : 0;
    return n >= 1 && n <= 1024 ? uint32_t(n) : sm90::kDefaultPromotionInterval;
  }();
  return interval;
}

namespace {

// Stream-K pays for its partial-tile fix-up only when data-parallel tiles cannot fill the GPU:
// e.g. problem 84 at M <= 512 has at most 128 tiles of 128x256 for 132 SMs. The output is
// rows x cols (z, or z^T for a transposed kernel), cut into tile_m x tile_n tiles.
bool prefer_stream_k(int64_t rows, int64_t cols, int64_t tile_m, int64_t tile_n, int sms) {
  return ((rows + tile_m - 1) / tile_m) * ((cols + tile_n - 1) / tile_n) < sms;
}

// Batches of at most this many rows run the transposed GEMM (Schedule::kSmallM). Below 128 rows the
// 128x256 tile is mostly padding (8x the useful TF32 math at M = 16); up to a few hundred rows its
// 128 tiles or fewer leave stream-K to split the K loop into many partial tiles, where the
// transposed 128x64 tiles are more, smaller units. 384: where the two met on an H200 (BENCHMARKS.md,
// "Kernel selection").
constexpr int64_t kSmallBatchRows = 384;

bool small_batch(const GemmProblem& p) { return p.M <= kSmallBatchRows; }

// Narrow outputs: where the wide tiles (128x256 over z or z^T) cover only a fraction of the SMs (a
// projection's 256-column last layer at a batch of 4096: 32 tiles), stream-K cuts every tile's K
// loop several ways and fixes the partial tiles up; the transposed 128x64 tiles of SmallM are four
// times as many whole tiles. Measured on an H200 (BENCHMARKS.md, "Kernel selection"): at 32 wide
// tiles SmallM is 27-37% faster in bf16 and TF32; at 64 it is 9-17% faster in bf16 but 12-40%
// slower in TF32, so 16-bit problems switch at half the SMs and fp32 ones at a quarter.
// EPIFUSE_NARROW_SMALL_M=0 keeps stream-K there (to measure the two); read once.
bool narrow_small_m_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("EPIFUSE_NARROW_SMALL_M");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

bool narrow_output(const GemmProblem& p, int64_t wide_tiles, int sms) {
  const int64_t divisor = p.dtype == DType::kFloat32 ? 4 : 2;
  return narrow_small_m_enabled() && divisor * wide_tiles <= sms;
}

// The row of the generated table with these keys (-1: none, a hole in generate_kernels.py's table).
int find_sm90_kernel(DType dtype, MathMode math, Epilogue e, sm90::Schedule schedule) {
  for (int i = 0; i < sm90::kKernelCount; ++i) {
    const sm90::KernelInfo& k = sm90::kKernels[i];
    if (k.dtype == dtype && k.math == math && k.epilogue == e && k.schedule == schedule) return i;
  }
  return -1;
}

// The Hopper kernel of a problem (for the split plan: of the split problem, same M and N):
//   small batches, narrow outputs: the transposed 128x64 tiles (both epilogues);
//   eval:          the wide tiles over z;
//   training:      the wide tiles over z^T (sm90_gemm_configs.hpp says why);
// each with stream-K when its tiles are fewer than the SMs.
int sm90_kernel(const GemmProblem& p, Epilogue e, int sms) {
  using sm90::Schedule;
  auto find = [&](Schedule s) { return find_sm90_kernel(p.dtype, kernel_math(p), e, s); };
  int kernel = -1;
  if (small_batch(p)) {
    kernel = find(Schedule::kSmallM);
  } else {
    // The wide tiles cover z (eval) or z^T (training): rows x cols of the kernel's output.
    const bool eval = e == Epilogue::kAffine;
    const int wide = find(eval ? Schedule::kWide : Schedule::kWideTransposed);
    if (wide < 0) throw std::logic_error("epifuse: no Hopper kernel for this mode and epilogue");
    const int64_t rows = eval ? p.M : p.N, cols = eval ? p.N : p.M;
    const int64_t tile_m = sm90::kKernels[wide].tile_m, tile_n = sm90::kKernels[wide].tile_n;
    const int64_t wide_tiles = ((rows + tile_m - 1) / tile_m) * ((cols + tile_n - 1) / tile_n);
    if (narrow_output(p, wide_tiles, sms)) {
      kernel = find(Schedule::kSmallM);
    } else if (prefer_stream_k(rows, cols, tile_m, tile_n, sms)) {
      kernel = find(eval ? Schedule::kWideSK : Schedule::kWideTransposedSK);
    } else {
      kernel = wide;
    }
  }
  if (kernel < 0) throw std::logic_error("epifuse: no Hopper kernel for this mode and epilogue");
  return kernel;
}

template <class Config, class Tag>
size_t sm90_workspace_bytes(const GemmProblem& p, int device, int sms) {
  if constexpr (Tag::value == Epilogue::kAffine) {
    return sm90::affine_workspace_bytes<Config>(p, device, sms);
  } else {
    return sm90::column_stats_workspace_bytes<Config>(p, device, sms);
  }
}

template <class Config, class Tag>
void sm90_run(const GemmProblem& p, const EpilogueOperands& ops, void* workspace, int device,
              int sms, cudaStream_t stream) {
  if constexpr (Tag::value == Epilogue::kAffine) {
    sm90::run_affine<Config>(p, ops, workspace, device, sms, stream);
  } else {
    sm90::run_column_stats<Config>(p, ops, workspace, device, sms, stream);
  }
}

// The 3x plan's workspace: [x split][flags of x's non-finite rows][w split, unless p.w_split]
// [the GEMM's own workspace].
// The GEMM itself sees the split operands: K' = split_fp16_ld(K) FP16 hi/lo parts per row, and
// the exponents of their rows.
GemmProblem split_problem(const GemmProblem& p, const void* x_split, const void* w_split) {
  GemmProblem s = p;
  s.K = split_fp16_ld(p.K);
  s.x = x_split;
  s.ldx = s.K;
  s.w = w_split;
  s.ldw = s.K;
  s.x_col_stride = s.w_col_stride = 1;
  s.w_split = nullptr;
  // Where each split keeps its rows' exponents (a split of this problem's M rows / N rows).
  s.x_exponents = x_split != nullptr ? split_fp16_exponents(x_split, p.M, p.K) : nullptr;
  s.w_exponents = w_split != nullptr ? split_fp16_exponents(w_split, p.N, p.K) : nullptr;
  return s;
}

size_t row_flag_bytes(const GemmProblem& p) { return (sizeof(int) * size_t(p.M) + 255) / 256 * 256; }

// Large products (the affine epilogue, whose chunks of x's rows are independent): chunks finer than
// the byte budgets while each GEMM keeps at least kMinChunkTiles 128x128 tiles (~8 waves on 132
// SMs, so the last wave's idle SMs cost little), halving the larger of the two chunks each time
// (balanced chunks hold the fewest split bytes for their tiles). Problem 84's dW (8192 x 8192 from
// K = 1024): x's and w's splits of 64 MiB each become two chunks of 32 MiB each, four GEMMs of 1024
// tiles, and the step's peak drops from 1.23x eager's to 1.08x (BENCHMARKS.md).
constexpr int64_t kMinChunkTiles = 1024;

void refine_split_chunks(int64_t M, int64_t N, int64_t& x_chunk, int64_t& w_chunk) {
  auto tiles = [](int64_t r, int64_t c) { return ((r + 127) / 128) * ((c + 127) / 128); };
  auto half = [](int64_t n) { return ((n + 1) / 2 + 255) / 256 * 256; };
  while (tiles(x_chunk, w_chunk) >= 2 * kMinChunkTiles) {
    int64_t& larger = x_chunk > w_chunk ? x_chunk : w_chunk;
    if (larger <= 256 || half(larger) >= larger) break;
    larger = half(larger);
  }
  x_chunk = std::min(x_chunk, M);
  w_chunk = std::min(w_chunk, N);
}

// Output rows [r0, r0 + m) of p: x's rows r0.., out's rows r0..
GemmProblem row_chunk(const GemmProblem& p, int64_t r0, int64_t m) {
  GemmProblem c = p;
  c.M = m;
  c.x = static_cast<const float*>(p.x) + r0 * p.ldx;
  c.out = static_cast<float*>(p.out) + r0 * p.ldo;
  return c;
}

// Output columns [c0, c0 + n) of p: w's rows c0.., out's columns c0.. (row strides unchanged).
GemmProblem column_chunk(const GemmProblem& p, int64_t c0, int64_t n) {
  GemmProblem c = p;
  c.N = n;
  c.w = static_cast<const float*>(p.w) + c0 * p.ldw;
  c.out = static_cast<float*>(p.out) + c0;
  return c;
}

EpilogueOperands column_chunk(const EpilogueOperands& ops, int64_t c0) {
  EpilogueOperands c = ops;
  if (c.a != nullptr) c.a += c0;
  if (c.c != nullptr) c.c += c0;
  if (c.colsum != nullptr) c.colsum += c0;
  if (c.colsumsq != nullptr) c.colsumsq += c0;
  return c;
}
#endif

// The sm80 kernel of a problem: one per mode and epilogue (its stream-K schedule sizes itself).
int sm80_kernel(const GemmProblem& p, Epilogue e) {
  for (int i = 0; i < sm80::kKernelCount; ++i) {
    const sm80::KernelInfo& k = sm80::kKernels[i];
    if (k.dtype == p.dtype && k.math == kernel_math(p) && k.epilogue == e) return i;
  }
  throw std::logic_error("epifuse: no sm80 kernel for this mode and epilogue");
}

template <class Config, class Tag>
size_t sm80_workspace_bytes(const GemmProblem& p) {
  if constexpr (Tag::value == Epilogue::kAffine) {
    return sm80::affine_workspace_bytes<Config>(p);
  } else {
    return sm80::column_stats_workspace_bytes<Config>(p);
  }
}

template <class Config, class Tag>
void sm80_run(const GemmProblem& p, const EpilogueOperands& ops, void* workspace,
              cudaStream_t stream) {
  if constexpr (Tag::value == Epilogue::kAffine) {
    sm80::run_affine<Config>(p, ops, workspace, stream);
  } else {
    sm80::run_column_stats<Config>(p, ops, workspace, stream);
  }
}

// One entry of EPIFUSE_BUILT_ARCHS ("80", "86", "90a"): the last digit is the minor version.
bool arch_runs_on(const std::string& arch, int cc_major, int cc_minor) {
  const bool specific = !arch.empty() && arch.back() == 'a';  // sm_90a code runs on 9.0 only
  const std::string digits = specific ? arch.substr(0, arch.size() - 1) : arch;
  if (digits.size() < 2) return false;
  const int major = std::atoi(digits.substr(0, digits.size() - 1).c_str());
  const int minor = digits.back() - '0';
  return major == cc_major && (specific ? minor == cc_minor : minor <= cc_minor);
}

}  // namespace

const char* built_archs() { return EPIFUSE_BUILT_ARCHS; }

bool supports_device(int cc_major, int cc_minor) {
  const std::string archs = EPIFUSE_BUILT_ARCHS;
  size_t start = 0;
  while (start < archs.size()) {
    size_t end = archs.find(',', start);
    if (end == std::string::npos) end = archs.size();
    if (arch_runs_on(archs.substr(start, end - start), cc_major, cc_minor)) return true;
    start = end + 1;
  }
  return false;
}

GemmPlan gemm_plan(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops, int device,
                   int cc_major, int cc_minor) {
  GemmPlan plan;
  plan.M = p.M;
  plan.N = p.N;
  plan.K = p.K;
  plan.dtype = p.dtype;
  plan.math = p.math;
  plan.epilogue = e;
  plan.device = device;
  plan.kind = choose_kind(p, e, ops, cc_major, cc_minor);
  plan.host_sgemm = plan.kind == GemmKernelKind::kHostSgemm;
  plan.splits_operands = plan.kind == GemmKernelKind::kSm90Split3x;
  if (plan.kind != GemmKernelKind::kEmpty && !plan.splits_operands)
    plan.copies = unit_stride_copies(p);
  // The kernels' workspaces depend on the shape and the GPU, not on the operands' pointers or row
  // strides, so the operand copies leave them as they are.
#if EPIFUSE_HAVE_SM90
  if (plan.kind == GemmKernelKind::kSm90 || plan.splits_operands) {
    plan.sm_count = sm_count(device);
    auto kernel_and_workspace = [&](const GemmProblem& gp, int& kernel) {
      kernel = sm90_kernel(gp, e, plan.sm_count);
      size_t bytes = 0;
      sm90::with_kernel(kernel, [&](auto cfg, auto tag) {
        bytes = sm90_workspace_bytes<decltype(cfg), decltype(tag)>(gp, device, plan.sm_count);
      });
      return bytes;
    };
    if (!plan.splits_operands) {
      plan.workspace_bytes = kernel_and_workspace(p, plan.kernel);
    } else {
      // x's split in chunks of its rows (affine epilogue only), w's in chunks of its rows unless
      // the caller gives w's split; one GEMM per pair of chunks (kernel_and_workspace plans the
      // full chunk; the GEMM workspace covers the narrower last chunks on the same kernel too).
      const int64_t split_row_bytes = int64_t(split_fp16_row_bytes(p.K));
      plan.x_chunk = e == Epilogue::kAffine
                         ? copy_chunk_rows(p.M, size_t(split_row_bytes), kXCopyChunkBytes)
                         : p.M;
      plan.w_chunk = copy_chunk_rows(p.N, size_t(split_row_bytes), kWCopyChunkBytes);
      if (e == Epilogue::kAffine) refine_split_chunks(p.M, p.N, plan.x_chunk, plan.w_chunk);
      const size_t x_bytes = split_fp16_bytes(plan.x_chunk, p.K) + row_flag_bytes(p);
      auto chunks_workspace = [&](int64_t n_chunk, int& kernel) {
        GemmProblem c = p;
        c.M = plan.x_chunk;
        c.N = n_chunk;
        size_t bytes = kernel_and_workspace(split_problem(c, nullptr, nullptr), kernel);
        // The ragged last chunks' (the full chunk's is `bytes` already).
        for (const int64_t m : {plan.x_chunk, p.M % plan.x_chunk}) {
          for (const int64_t n : {n_chunk, p.N % n_chunk}) {
            if (m == 0 || n == 0 || (m == plan.x_chunk && n == n_chunk)) continue;
            c.M = m;
            c.N = n;
            sm90::with_kernel(kernel, [&](auto cfg, auto tag) {
              bytes = std::max(bytes, sm90_workspace_bytes<decltype(cfg), decltype(tag)>(
                                          split_problem(c, nullptr, nullptr), device,
                                          plan.sm_count));
            });
          }
        }
        return bytes;
      };
      plan.workspace_bytes_given_split = x_bytes + chunks_workspace(p.N, plan.kernel);
      plan.weight_split_bytes = split_fp16_bytes(plan.w_chunk, p.K);
      plan.workspace_bytes =
          x_bytes + plan.weight_split_bytes + chunks_workspace(plan.w_chunk, plan.chunk_kernel);
    }
    plan.kernel_name = sm90::kKernels[plan.kernel].name;
    return plan;
  }
#endif
  if (plan.kind == GemmKernelKind::kSm80) {
    plan.kernel = sm80_kernel(p, e);
    plan.kernel_name = sm80::kKernels[plan.kernel].name;
    sm80::with_kernel(plan.kernel, [&](auto cfg, auto tag) {
      plan.workspace_bytes = sm80_workspace_bytes<decltype(cfg), decltype(tag)>(p);
    });
  }
  return plan;
}

size_t gemm_workspace_bytes(const GemmPlan& plan, const GemmProblem& p) {
  return plan.splits_operands && p.w_split != nullptr ? plan.workspace_bytes_given_split
                                                      : plan.workspace_bytes;
}

// TF32 wgmma reads only K-major tiles, so cuBLAS multiplies MN-major fp32 operands on slower
// kernels; how much slower depends on which operand is MN-major (H200, cuBLAS 13, the backward's
// shapes; benchmarks/kernels/tf32_operand_layouts.cu, BENCHMARKS.md "K-major copies for cuBLAS
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

// EPIFUSE_TF32_K_MAJOR_COPIES=0 turns the copies off (to measure them); read once.
static bool k_major_copies_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("EPIFUSE_TF32_K_MAJOR_COPIES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

KMajorCopies cublas_tf32_k_major_copies(const GemmProblem& p, int cc_major, int cc_minor) {
  KMajorCopies copies;
  // 16-bit wgmma reads MN-major tiles as they are; sm80 is unmeasured.
  const bool hopper_tf32 = p.dtype == DType::kFloat32 && p.math == MathMode::kTF32 &&
                           cc_major == 9 && cc_minor == 0;
  if (!hopper_tf32 || !k_major_copies_enabled()) return copies;
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
    const int64_t rows = copy_chunk_rows(p.N, sizeof(float) * size_t(std::max<int64_t>(p.K, 1)),
                                         kWCopyChunkBytes);
    copies.w_chunk = rows < p.N ? rows : 0;
  }
  return copies;
}

// EPIFUSE_FP16_PRODUCT=0 keeps the fp16 products on cuBLAS + fp16_overflow_ (to measure the
// Hopper kernel against them); read once.
static bool fp16_product_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("EPIFUSE_FP16_PRODUCT");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

Fp16ProductPlan plan_fp16_product(const Fp16Product& p, int device, int cc_major, int cc_minor) {
  Fp16ProductPlan plan;
  plan.device = device;
#if EPIFUSE_HAVE_SM90
  if (cc_major == 9 && cc_minor == 0 && fp16_product_enabled() && is_aligned16(p.a) &&
      is_aligned16(p.b) && is_aligned16(p.out)) {
    plan.sm_count = sm_count(device);
    plan.hopper = sm90::fp16_product_can_implement(p, device, plan.sm_count);
    if (plan.hopper) plan.workspace_bytes = sm90::fp16_product_workspace_bytes(p, device, plan.sm_count);
  }
#else
  (void)p, (void)cc_major, (void)cc_minor;
#endif
  return plan;
}

void run_fp16_product(const Fp16ProductPlan& plan, const Fp16Product& p, void* workspace,
                      cudaStream_t stream) {
#if EPIFUSE_HAVE_SM90
  if (plan.hopper) {
    sm90::run_fp16_product(p, workspace, plan.device, plan.sm_count, stream);
    return;
  }
#endif
  (void)p, (void)workspace, (void)stream;
  throw std::logic_error("epifuse: run_fp16_product without a Hopper plan");
}

size_t split_weight_bytes(const GemmProblem& p) { return split_fp16_bytes(p.N, p.K); }

void split_weight(const GemmProblem& p, void* dst, cudaStream_t stream) {
  split_fp16(static_cast<const float*>(p.w), p.N, p.K, p.ldw, p.w_col_stride, dst, nullptr, stream);
}

void epilogue_pass(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops, cudaStream_t stream) {
  if (e == Epilogue::kAffine) {
    column_affine(p.dtype, p.M, p.N, p.out, p.ldo, ops.a, ops.c, ops.act, stream);
  } else {
    fallback::column_stats(p.dtype, p.M, p.N, p.out, p.ldo, ops.colsum, ops.colsumsq, stream);
  }
}

namespace {

// CUTLASS's can_implement for a plan: the launch is the planned problem (its operand copies bound in)
// and the planned epilogue vectors.
void can_implement(const GemmPlan& plan, const GemmProblem& p, const EpilogueOperands& ops) {
  bool ok = p.M == plan.M && p.N == plan.N && p.K == plan.K && p.dtype == plan.dtype &&
            p.math == plan.math;
  if (ok && plan.kind == GemmKernelKind::kSm90Split3x) {
    ok = output_aligned(p, plan.epilogue, ops);
  } else if (ok && (plan.kind == GemmKernelKind::kSm90 || plan.kind == GemmKernelKind::kSm80)) {
    ok = vector_aligned(p, plan.epilogue, ops, KMajorCopies{});
  }
  if (!ok)
    throw std::invalid_argument(std::string("epifuse: gemm_run given a problem its plan (") +
                                plan.kernel_name + ") was not made for");
}

}  // namespace

void gemm_run(const GemmPlan& plan, const GemmProblem& p, const EpilogueOperands& ops,
              void* workspace, cudaStream_t stream) {
  can_implement(plan, p, ops);
  const Epilogue e = plan.epilogue;
  switch (plan.kind) {
    case GemmKernelKind::kEmpty:
      if (e == Epilogue::kColumnStats && p.N > 0) {  // no rows: the sums are zero
        cudaMemsetAsync(ops.colsum, 0, sizeof(double) * p.N, stream);
        cudaMemsetAsync(ops.colsumsq, 0, sizeof(double) * p.N, stream);
      }
      return;
    case GemmKernelKind::kPortable:
    case GemmKernelKind::kHostSgemm:  // no host library here: SIMT
      if (p.K == 0) {  // an empty sum: z = 0 (and x, w may have no storage for a kernel to read)
        const size_t elt = p.dtype == DType::kFloat32 ? 4 : 2;
        cudaMemset2DAsync(p.out, p.ldo * elt, 0, p.N * elt, p.M, stream);
      } else {
        fallback::gemm(p, stream);
      }
      epilogue_pass(p, e, ops, stream);
      return;
#if EPIFUSE_HAVE_SM90
    case GemmKernelKind::kSm90Split3x: {
      // For each chunk of x's rows: its split, then the GEMMs on the split operands, on w's split
      // as given (one GEMM) or on w split here chunk by chunk (a w of one chunk is split once).
      // Each split reuses its buffer: launches on one stream run in order. The GEMM's own
      // workspace follows the splits.
      char* base = static_cast<char*>(workspace);
      void* x_split = base;
      base += split_fp16_bytes(plan.x_chunk, p.K);
      auto* row_flags = reinterpret_cast<int*>(base);
      base += row_flag_bytes(p);
      void* w_split = nullptr;
      if (p.w_split == nullptr) {
        w_split = base;
        base += plan.weight_split_bytes;
      }
      auto run = [&](int kernel, const GemmProblem& sp, const EpilogueOperands& o) {
        sm90::with_kernel(kernel, [&](auto cfg, auto tag) {
          sm90_run<decltype(cfg), decltype(tag)>(sp, o, base, plan.device, plan.sm_count, stream);
        });
      };
      bool w_split_made = false;
      for (int64_t r0 = 0; r0 < p.M; r0 += plan.x_chunk) {
        const GemmProblem rows = row_chunk(p, r0, std::min(plan.x_chunk, p.M - r0));
        split_fp16(static_cast<const float*>(rows.x), rows.M, p.K, p.ldx, p.x_col_stride, x_split,
                   row_flags + r0, stream);
        if (p.w_split != nullptr) {
          run(plan.kernel, split_problem(rows, x_split, p.w_split), ops);
          continue;
        }
        for (int64_t c0 = 0; c0 < p.N; c0 += plan.w_chunk) {
          const GemmProblem chunk = column_chunk(rows, c0, std::min(plan.w_chunk, p.N - c0));
          if (!w_split_made || plan.w_chunk < p.N) split_weight(chunk, w_split, stream);
          w_split_made = true;
          run(plan.chunk_kernel, split_problem(chunk, x_split, w_split), column_chunk(ops, c0));
        }
      }
      // The split turns the +-Inf of a row of x into NaN; IEEE math for those rows (the affine
      // epilogue's activation included).
      const bool affine = e == Epilogue::kAffine;
      recompute_nonfinite_rows(p, affine ? ops.a : nullptr, affine ? ops.c : nullptr,
                               affine ? ops.act : Activation{}, row_flags, stream);
      return;
    }
    case GemmKernelKind::kSm90:
      sm90::with_kernel(plan.kernel, [&](auto cfg, auto tag) {
        sm90_run<decltype(cfg), decltype(tag)>(p, ops, workspace, plan.device, plan.sm_count,
                                               stream);
      });
      return;
#endif
    case GemmKernelKind::kSm80:
      sm80::with_kernel(plan.kernel, [&](auto cfg, auto tag) {
        sm80_run<decltype(cfg), decltype(tag)>(p, ops, workspace, stream);
      });
      // 3xTF32 turns the +-Inf of a row of x into NaN (big/small split); IEEE math for those rows.
      if (sm80::kKernels[plan.kernel].math == MathMode::k3xTF32) {
        const bool affine = e == Epilogue::kAffine;
        recompute_nonfinite_rows(p, affine ? ops.a : nullptr, affine ? ops.c : nullptr,
                                 Activation{}, nullptr, stream);
      }
      // CUTLASS 2.x compute nodes take no runtime arguments: the sm80 tree stores the affine, and
      // the activation is one more pass over the output.
      if (e == Epilogue::kAffine && ops.act.kind != ActivationKind::kNone) {
        column_affine(p.dtype, p.M, p.N, p.out, p.ldo, nullptr, nullptr, ops.act, stream);
      }
      return;
    default:
      throw std::logic_error("epifuse: this build has no kernels for the plan");
  }
}

}  // namespace epifuse
