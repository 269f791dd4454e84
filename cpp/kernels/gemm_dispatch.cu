// Chooses the kernel sequence for a GEMM + epilogue problem. The only place with shape heuristics.
//
//   Hopper (sm_90), 3xTF32 math (fp32 accuracy), 16-byte aligned output rows: the operands split
//                    into TF32 hi/lo parts (split_tf32.cu; the weight's split may come cached), then
//                    the same GEMMs with the 3xTF32 mainloop (sm90_mainloop_3xtf32.hpp), 128x128 tiles.
//   Hopper (sm_90), TF32 or 16-bit math, 16-byte aligned rows (K, N, leading dimensions and base
//   pointers):       one CUTLASS sm90 GEMM (TMA + wgmma) with the epilogue fused (epilogues.hpp);
//                    eval as z = x . w^T, training as z^T = w . x^T (per-column statistics become
//                    per-row reductions of the tile); stream-K when the output tiles cannot fill the
//                    SMs; batches of <= 384 rows transposed with narrow tiles (small_batch).
//   sm_80 and later otherwise (A100, Ada, or Hopper when EPIFUSE_FORCE_SM80=1), same alignment:
//                    one CUTLASS 2.x GEMM (cp.async + mma.sync) with the
//                    epilogue fused (sm80_epilogues.hpp); its stream-K schedule sizes itself.
//   IEEE fp32, and 3xTF32 with few rows (the GEMM is bound by reading the weight, and the split
//   would double the bytes read): cuBLAS's SGEMM, run by the op layer (gemm_uses_host_sgemm), then
//                    the epilogue as a separate pass.
//   Anything else (ragged alignment, or IEEE without the op layer): the portable SIMT GEMM writing
//                    z, then the epilogue as a separate pass (column_stats.cu / column_affine.cu).
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "cuda_utils.cuh"
#include "fallback.hpp"
#include "nonfinite_rows.hpp"
#include "sm80_gemm_configs.hpp"
#include "split_tf32.hpp"
#if EPIFUSE_HAVE_SM90
#include "sm90_gemm_configs.hpp"
#endif

#ifndef EPIFUSE_BUILT_ARCHS
#error "EPIFUSE_BUILT_ARCHS must name the compiled architectures (CMakeLists.txt defines it)"
#endif

namespace epifuse {
namespace {

enum class Plan {
  kEmpty, kFallback, kHostSgemm,
  kSm90Tf32, kSm90Bf16, kSm90Fp16, kSm90Split3xTf32,
  kSm80Tf32, kSm80Fast3xTf32, kSm80Bf16, kSm80Fp16,
};

[[maybe_unused]] bool is_sm90_plan(Plan p) {
  return p == Plan::kSm90Tf32 || p == Plan::kSm90Bf16 || p == Plan::kSm90Fp16 ||
         p == Plan::kSm90Split3xTf32;
}

// What both tensor-core paths need: 16-byte aligned rows for TMA / cp.async, and int32 extents.
// The epilogue's side: output rows and per-column vectors.
bool output_aligned(const GemmProblem& p, Epilogue e, const EpilogueOperands* ops) {
  const int64_t align = p.dtype == DType::kFloat32 ? 4 : 8;  // elements per 16 bytes
  if (p.N % align || p.ldo % align || !is_aligned16(p.out)) return false;
  if (p.M > INT_MAX || p.N > INT_MAX) return false;
  if (ops != nullptr) {  // the epilogue's per-column vectors are read / written as 16-byte vectors
    if (e == Epilogue::kAffine && !(is_aligned16(ops->a) && is_aligned16(ops->c))) return false;
    if (e == Epilogue::kColumnStats && !(is_aligned16(ops->colsum) && is_aligned16(ops->colsumsq)))
      return false;
  }
  return true;
}

bool vector_aligned(const GemmProblem& p, Epilogue e, const EpilogueOperands* ops) {
  const int64_t align = p.dtype == DType::kFloat32 ? 4 : 8;  // elements per 16 bytes
  if (p.K % align || p.ldx % align || p.ldw % align || p.x_col_stride != 1 || p.w_col_stride != 1)
    return false;
  if (!is_aligned16(p.x) || !is_aligned16(p.w) || p.K > INT_MAX) return false;
  return output_aligned(p, e, ops);
}

// EPIFUSE_FORCE_SM80=1 runs the sm80 kernels on Hopper too (to test them there); read once.
bool force_sm80() {
  static const bool forced = [] {
    const char* v = std::getenv("EPIFUSE_FORCE_SM80");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return forced;
}

// Where 3xTF32 gives way to cuBLAS's SGEMM (both fp32-accurate):
//  - below kSplitMinRows rows the GEMM is bound by reading the weight, which the split doubles
//    (hi and lo parts); SGEMM reads it once. Estimated for problem 84's 8192x8192 weight on an H100
//    (~3 TB/s, SGEMM ~50 TFLOP/s, 3xTF32 130-135): the two meet near 64 rows.
//  - at small K, 3xTF32's error is not clearly below SGEMM's (it drops lo*lo, ~2^-22 per product,
//    while SGEMM's own error grows with K): max error ratio 1.17 at K = 16, 0.98 at K = 32, 0.67 at
//    K = 64 (H100, promotion every K-tile, sm90_mainloop_3xtf32.hpp); kSplitMinK keeps a margin.
//  - below kSplitMinMacs multiply-adds the split, the row flags and the repair pass (three more
//    launches, ~50 us of host time) cost more than SGEMM's whole run: problem 84's 128x1024->512
//    eval forward took 0.173 ms at 3xTF32 against eager SGEMM's 0.106 ms (H100).
constexpr int64_t kSplitMinRows = 64;
constexpr int64_t kSplitMinK = 64;
constexpr double kSplitMinMacs = double(1 << 30);

bool split_pays(const GemmProblem& p) {
  return p.M >= kSplitMinRows && p.K >= kSplitMinK &&
         double(p.M) * double(p.N) * double(p.K) >= kSplitMinMacs;
}

Plan choose_plan(const GemmProblem& p, Epilogue e, const EpilogueOperands* ops, int cc_major,
                 int cc_minor) {
  if (p.M == 0 || p.N == 0) return Plan::kEmpty;
  if (cc_major < 8 || p.K == 0) return Plan::kFallback;
  if (p.dtype == DType::kFloat32 &&
      (p.math == MathMode::kIEEE || (p.math == MathMode::k3xTF32 && !split_pays(p))))
    return Plan::kHostSgemm;
  const bool wgmma = EPIFUSE_HAVE_SM90 && cc_major == 9 && cc_minor == 0 && !force_sm80();
  // The split copies the operands into an aligned layout, so only the output side must be aligned.
  if (wgmma && p.dtype == DType::kFloat32 && p.math == MathMode::k3xTF32 &&
      output_aligned(p, e, ops) && split_tf32_ld(p.K) <= INT_MAX)
    return Plan::kSm90Split3xTf32;
  if (!vector_aligned(p, e, ops)) return Plan::kFallback;
  switch (p.dtype) {
    case DType::kFloat32:
      if (p.math == MathMode::k3xTF32) return Plan::kSm80Fast3xTf32;
      return wgmma ? Plan::kSm90Tf32 : Plan::kSm80Tf32;
    case DType::kBFloat16: return wgmma ? Plan::kSm90Bf16 : Plan::kSm80Bf16;
    case DType::kFloat16: return wgmma ? Plan::kSm90Fp16 : Plan::kSm80Fp16;
  }
  return Plan::kFallback;
}

#if EPIFUSE_HAVE_SM90
}  // namespace

// Declared in sm90_gemm.cuh; read once.
uint32_t sm90::split3xtf32_promotion_interval() {
  static const uint32_t interval = [] {
    const char* v = std::getenv("EPIFUSE_3XTF32_PROMOTION");
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

// Batches of at most this many rows run the transposed GEMM (sm90_gemm_configs.hpp, SmallM). Below
// 128 rows the 128x256 tile is mostly padding (8x the useful TF32 math at M = 16); up to a few
// hundred rows its 128 tiles or fewer leave stream-K to split the K loop into many partial tiles,
// where the transposed 128x64 tiles are more, smaller units. Measured on an H200 with problem 84's
// weights (8192x8192), affine GEMM in us, 128x256 / transposed:
//   TF32  M = 96: 133 / 92,  128: 133 / 85,  192: 133 / 108,  256: 137 / 125,  384: 205 / 198
//   bf16  M = 96:  76 / 55,  128:  75 / 51,  192:  73 /  66,  256:  75 /  68,  384: 105 /  98
constexpr int64_t kSmallBatchRows = 384;

bool small_batch(const GemmProblem& p) { return p.M <= kSmallBatchRows; }

// The Hopper configurations of one input type (sm90_gemm_configs.hpp).
template <class Wide_, class WideSK_, class WideTransposed_, class WideTransposedSK_, class SmallM_>
struct Sm90Configs {
  using Wide = Wide_;
  using WideSK = WideSK_;
  using WideTransposed = WideTransposed_;
  using WideTransposedSK = WideTransposedSK_;
  using SmallM = SmallM_;
};

// The epilogue as a type, so that a configuration is only ever paired with an epilogue it is
// instantiated for (sm90_gemm_configs.hpp).
using AffineTag = std::integral_constant<Epilogue, Epilogue::kAffine>;
using StatsTag = std::integral_constant<Epilogue, Epilogue::kColumnStats>;

// Calls fn(Config, EpilogueTag) with the tile configuration of a Hopper problem:
//   small batches: the transposed 128x64 tiles (both epilogues);
//   eval:          128x256 tiles over z;
//   training:      128x256 tiles over z^T (sm90_gemm_configs.hpp says why and what it measured);
// each with stream-K when its tiles are fewer than the SMs.
template <class Configs, class Fn>
void pick_config(const GemmProblem& p, Epilogue e, int sms, Fn&& fn) {
  using WideTile = typename Configs::Wide::TileShape;
  constexpr int64_t tile_m = decltype(cute::size<0>(WideTile{}))::value;
  constexpr int64_t tile_n = decltype(cute::size<1>(WideTile{}))::value;
  if (e == Epilogue::kAffine) {
    if (small_batch(p)) return fn(typename Configs::SmallM{}, AffineTag{});
    if (prefer_stream_k(p.M, p.N, tile_m, tile_n, sms))
      return fn(typename Configs::WideSK{}, AffineTag{});
    return fn(typename Configs::Wide{}, AffineTag{});
  }
  if (small_batch(p)) return fn(typename Configs::SmallM{}, StatsTag{});
  if (prefer_stream_k(p.N, p.M, tile_m, tile_n, sms))
    return fn(typename Configs::WideTransposedSK{}, StatsTag{});
  return fn(typename Configs::WideTransposed{}, StatsTag{});
}

template <class Fn>
void with_sm90_config(Plan plan, const GemmProblem& p, Epilogue e, int sms, Fn&& fn) {
  using namespace sm90;
  switch (plan) {
    case Plan::kSm90Tf32:
      return pick_config<Sm90Configs<Tf32Wide, Tf32WideSK, Tf32WideTransposed, Tf32WideTransposedSK,
                                     Tf32SmallM>>(p, e, sms, fn);
    case Plan::kSm90Bf16:
      return pick_config<Sm90Configs<Bf16Wide, Bf16WideSK, Bf16WideTransposed, Bf16WideTransposedSK,
                                     Bf16SmallM>>(p, e, sms, fn);
    case Plan::kSm90Fp16:
      return pick_config<Sm90Configs<Fp16Wide, Fp16WideSK, Fp16WideTransposed, Fp16WideTransposedSK,
                                     Fp16SmallM>>(p, e, sms, fn);
    case Plan::kSm90Split3xTf32:
      return pick_config<Sm90Configs<Split3xTf32Wide, Split3xTf32WideSK, Split3xTf32WideTransposed,
                                     Split3xTf32WideTransposedSK, Split3xTf32SmallM>>(p, e, sms, fn);
    default: throw std::logic_error("epifuse: not a Hopper plan");
  }
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

// The 3xTF32 plan's workspace: [x split][flags of x's non-finite rows][w split, unless p.w_split]
// [the GEMM's own workspace].
// The GEMM itself sees the split operands: K' = split_tf32_ld(K) floats of hi/lo parts per row.
GemmProblem split_problem(const GemmProblem& p, const float* x_split, const float* w_split) {
  GemmProblem s = p;
  s.K = split_tf32_ld(p.K);
  s.x = x_split;
  s.ldx = s.K;
  s.w = w_split;
  s.ldw = s.K;
  s.x_col_stride = s.w_col_stride = 1;
  s.w_split = nullptr;
  return s;
}

size_t row_flag_bytes(const GemmProblem& p) { return (sizeof(int) * size_t(p.M) + 255) / 256 * 256; }

size_t split_operand_bytes(const GemmProblem& p) {
  return split_tf32_bytes(p.M, p.K) + row_flag_bytes(p) +
         (p.w_split != nullptr ? 0 : split_tf32_bytes(p.N, p.K));
}
#endif

// Calls fn(Config) with the configuration of an sm80 plan.
template <class Fn>
void with_sm80_config(Plan plan, Fn&& fn) {
  switch (plan) {
    case Plan::kSm80Tf32: return fn(sm80::Tf32{});
    case Plan::kSm80Fast3xTf32: return fn(sm80::Fast3xTf32{});
    case Plan::kSm80Bf16: return fn(sm80::Bf16{});
    case Plan::kSm80Fp16: return fn(sm80::Fp16{});
    default: throw std::logic_error("epifuse: not an sm80 plan");
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

bool gemm_uses_host_sgemm(const GemmProblem& p, Epilogue e, int cc_major, int cc_minor) {
  return choose_plan(p, e, nullptr, cc_major, cc_minor) == Plan::kHostSgemm;
}

bool gemm_splits_operands(const GemmProblem& p, Epilogue e, int cc_major, int cc_minor) {
  return choose_plan(p, e, nullptr, cc_major, cc_minor) == Plan::kSm90Split3xTf32;
}

// TF32 wgmma reads only K-major tiles, so cuBLAS runs an fp32 product with an MN-major operand on a
// slower kernel (it transposes in shared memory). Measured on an H200, median of 4 steps, ms:
//   dW = dZ^T . X, both MN-major:  problem 84 0.565 (243 TFLOP/s), 39 2.245 (245)
//   dX = dZ . W, W MN-major:        problem 84 0.336 (409),          39 1.684 (326)
//   eager's forward, K-major, the same flops:  problem 84 0.331,  39 1.466
// A K-major copy of an operand reads and writes it once (8 bytes per element at ~3.3 TB/s on an
// H100); it pays where that is under a quarter of the product at ~400 TFLOP/s: copying x [M, K]
// costs 8MK bytes against 2MNK flops, i.e. when N >= ~1900 (w [N, K]: when M >= ~1900). That keeps
// problem 84's dX (M = 1024: cuBLAS's MN-major kernel is fast there) and copies the rest.
// The copy must be a tiled transpose (transpose.cu): Tensor::contiguous of the transposed views
// gained nothing. TF32 training step on an H100, ms, copies off / contiguous() / transpose.cu:
//   problem 84: 1.394 / 1.359 / 1.278;  problem 39: 6.078 / 6.129 / 5.445 (eager 1.58, 7.07).
constexpr int64_t kKMajorCopyMinOther = 2048;

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
  copies.x = p.x_col_stride != 1 && p.N >= kKMajorCopyMinOther;
  copies.w = p.w_col_stride != 1 && p.M >= kKMajorCopyMinOther;
  return copies;
}

size_t split_weight_floats(const GemmProblem& p) { return size_t(p.N) * size_t(split_tf32_ld(p.K)); }

void split_weight(const GemmProblem& p, float* dst, cudaStream_t stream) {
  split_tf32(static_cast<const float*>(p.w), p.N, p.K, p.ldw, p.w_col_stride, dst, nullptr, stream);
}

size_t gemm_workspace_bytes(const GemmProblem& p, Epilogue e, int cc_major, int cc_minor) {
  const Plan plan = choose_plan(p, e, nullptr, cc_major, cc_minor);
  if (plan == Plan::kEmpty || plan == Plan::kFallback || plan == Plan::kHostSgemm) return 0;
  size_t bytes = 0;
#if EPIFUSE_HAVE_SM90
  if (is_sm90_plan(plan)) {
    const int device = current_device();
    const int sms = sm_count(device);
    const bool split = plan == Plan::kSm90Split3xTf32;
    const GemmProblem gp = split ? split_problem(p, nullptr, nullptr) : p;
    with_sm90_config(plan, gp, e, sms, [&](auto cfg, auto tag) {
      bytes = sm90_workspace_bytes<decltype(cfg), decltype(tag)>(gp, device, sms);
    });
    return bytes + (split ? split_operand_bytes(p) : 0);
  }
#endif
  with_sm80_config(plan, [&](auto cfg) {
    using Config = decltype(cfg);
    bytes = e == Epilogue::kAffine ? sm80::affine_workspace_bytes<Config>(p)
                                   : sm80::column_stats_workspace_bytes<Config>(p);
  });
  return bytes;
}

void epilogue_pass(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops, cudaStream_t stream) {
  if (e == Epilogue::kAffine) {
    column_affine(p.dtype, p.M, p.N, p.out, p.ldo, ops.a, ops.c, stream);
  } else {
    fallback::column_stats(p.dtype, p.M, p.N, p.out, p.ldo, ops.colsum, ops.colsumsq, stream);
  }
}

void gemm_run(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops, void* workspace,
              int device, int cc_major, int cc_minor, cudaStream_t stream) {
  // The plan must not depend on `ops` beyond what gemm_workspace_bytes saw: a misaligned vector
  // downgrades to the fallback, which needs no workspace, so the caller's buffer is always enough.
  const Plan plan = choose_plan(p, e, &ops, cc_major, cc_minor);
  if (plan == Plan::kEmpty) {
    if (e == Epilogue::kColumnStats && p.N > 0) {  // no rows: the sums are zero
      cudaMemsetAsync(ops.colsum, 0, sizeof(double) * p.N, stream);
      cudaMemsetAsync(ops.colsumsq, 0, sizeof(double) * p.N, stream);
    }
    return;
  }
  if (plan == Plan::kFallback || plan == Plan::kHostSgemm) {  // no host library here: SIMT
    if (p.K == 0) {  // an empty sum: z = 0 (and x, w may have no storage for a kernel to read)
      const size_t elt = p.dtype == DType::kFloat32 ? 4 : 2;
      cudaMemset2DAsync(p.out, p.ldo * elt, 0, p.N * elt, p.M, stream);
    } else {
      fallback::gemm(p, stream);
    }
    epilogue_pass(p, e, ops, stream);
    return;
  }
#if EPIFUSE_HAVE_SM90
  if (plan == Plan::kSm90Split3xTf32) {
    // Split x (and w, unless the caller kept its split) into the workspace, then the GEMM on the
    // split operands; its own workspace follows them.
    char* base = static_cast<char*>(workspace);
    auto* x_split = reinterpret_cast<float*>(base);
    base += split_tf32_bytes(p.M, p.K);
    auto* row_flags = reinterpret_cast<int*>(base);
    base += row_flag_bytes(p);
    split_tf32(static_cast<const float*>(p.x), p.M, p.K, p.ldx, p.x_col_stride, x_split, row_flags,
               stream);
    const float* w_split = p.w_split;
    if (w_split == nullptr) {
      split_weight(p, reinterpret_cast<float*>(base), stream);
      w_split = reinterpret_cast<const float*>(base);
      base += split_tf32_bytes(p.N, p.K);
    }
    const GemmProblem sp = split_problem(p, x_split, w_split);
    const int sms = sm_count(device);
    with_sm90_config(plan, sp, e, sms, [&](auto cfg, auto tag) {
      sm90_run<decltype(cfg), decltype(tag)>(sp, ops, base, device, sms, stream);
    });
    // The split turns the +-Inf of a row of x into NaN; IEEE math for those rows.
    const bool affine = e == Epilogue::kAffine;
    recompute_nonfinite_rows(p, affine ? ops.a : nullptr, affine ? ops.c : nullptr, row_flags,
                             stream);
    return;
  }
  if (is_sm90_plan(plan)) {
    const int sms = sm_count(device);
    with_sm90_config(plan, p, e, sms, [&](auto cfg, auto tag) {
      sm90_run<decltype(cfg), decltype(tag)>(p, ops, workspace, device, sms, stream);
    });
    return;
  }
#endif
  with_sm80_config(plan, [&](auto cfg) {
    using Config = decltype(cfg);
    if (e == Epilogue::kAffine) {
      sm80::run_affine<Config>(p, ops, workspace, stream);
    } else {
      sm80::run_column_stats<Config>(p, ops, workspace, stream);
    }
  });
  // 3xTF32 turns the +-Inf of a row of x into NaN (big/small split); IEEE math for those rows.
  if (plan == Plan::kSm80Fast3xTf32) {
    const bool affine = e == Epilogue::kAffine;
    recompute_nonfinite_rows(p, affine ? ops.a : nullptr, affine ? ops.c : nullptr, nullptr, stream);
  }
}

}  // namespace epifuse
