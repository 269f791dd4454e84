// Chooses the kernel sequence for a GEMM + epilogue problem. The only place with shape heuristics.
//
//   Hopper (sm_90), TF32 or 16-bit math, 16-byte aligned rows (K, N, leading dimensions and base
//   pointers):       one CUTLASS sm90 GEMM (TMA + wgmma) with the epilogue fused (epilogues.hpp);
//                    stream-K when the output tiles cannot fill the SMs; batches of <= 384
//                    rows as the transposed GEMM z^T = w . x^T (small_batch). Column statistics of
//                    all but the smallest GEMMs: the affine kernel stores z, an fp64 pass sums
//                    it (see stats_as_separate_pass).
//   sm_80 and later otherwise (A100, Ada, and Hopper for 3xTF32, which has no wgmma form, or when
//   EPIFUSE_FORCE_SM80=1), same alignment: one CUTLASS 2.x GEMM (cp.async + mma.sync) with the
//                    epilogue fused (sm80_epilogues.hpp); its stream-K schedule sizes itself.
//   Anything else (IEEE fp32, ragged alignment): the portable SIMT GEMM writing z, then the
//                    epilogue as a separate pass (column_stats.cu / column_affine.cu).
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda_utils.cuh"
#include "fallback.hpp"
#include "nonfinite_rows.hpp"
#include "sm80_gemm_configs.hpp"
#if EPIFUSE_HAVE_SM90
#include "sm90_gemm_configs.hpp"
#endif

#ifndef EPIFUSE_BUILT_ARCHS
#error "EPIFUSE_BUILT_ARCHS must name the compiled architectures (CMakeLists.txt defines it)"
#endif

namespace epifuse {
namespace {

enum class Plan {
  kEmpty, kFallback,
  kSm90Tf32, kSm90Bf16, kSm90Fp16,
  kSm80Tf32, kSm80Fast3xTf32, kSm80Bf16, kSm80Fp16,
};

[[maybe_unused]] bool is_sm90_plan(Plan p) { return p == Plan::kSm90Tf32 || p == Plan::kSm90Bf16 || p == Plan::kSm90Fp16; }

// What both tensor-core paths need: 16-byte aligned rows for TMA / cp.async, and int32 extents.
bool vector_aligned(const GemmProblem& p, Epilogue e, const EpilogueOperands* ops) {
  const int64_t align = p.dtype == DType::kFloat32 ? 4 : 8;  // elements per 16 bytes
  if (p.K % align || p.N % align || p.ldx % align || p.ldw % align || p.ldo % align) return false;
  if (!is_aligned16(p.x) || !is_aligned16(p.w) || !is_aligned16(p.out)) return false;
  if (p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX) return false;
  if (ops != nullptr) {  // the epilogue's per-column vectors are read / written as 16-byte vectors
    if (e == Epilogue::kAffine && !(is_aligned16(ops->a) && is_aligned16(ops->c))) return false;
    if (e == Epilogue::kColumnStats && !(is_aligned16(ops->colsum) && is_aligned16(ops->colsumsq)))
      return false;
  }
  return true;
}

// EPIFUSE_FORCE_SM80=1 runs the sm80 kernels on Hopper too (to test them there); read once.
bool force_sm80() {
  static const bool forced = [] {
    const char* v = std::getenv("EPIFUSE_FORCE_SM80");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return forced;
}

Plan choose_plan(const GemmProblem& p, Epilogue e, const EpilogueOperands* ops, int cc_major,
                 int cc_minor) {
  if (p.M == 0 || p.N == 0) return Plan::kEmpty;
  if (cc_major < 8 || p.K == 0 || p.math == MathMode::kIEEE || !vector_aligned(p, e, ops))
    return Plan::kFallback;
  const bool wgmma = EPIFUSE_HAVE_SM90 && cc_major == 9 && cc_minor == 0 && !force_sm80();
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
// Stream-K pays for its partial-tile fix-up only when data-parallel tiles cannot fill the GPU:
// e.g. problem 84 at M <= 512 has at most 128 tiles of 128x256 for 132 SMs.
bool prefer_stream_k(const GemmProblem& p, Epilogue e, int sms) {
  const bool affine = e == Epilogue::kAffine;  // 128x256 tiles; column statistics: 256x64
  const int64_t tile_m = affine ? 128 : 256, tile_n = affine ? 256 : 64;
  const int64_t tiles = ((p.M + tile_m - 1) / tile_m) * ((p.N + tile_n - 1) / tile_n);
  return tiles < sms;
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

// Calls fn(Config) with the tile configuration of a Hopper plan.
template <class Wide, class WideSK, class SmallM, class Tall, class TallSK, class Fn>
void pick_config(const GemmProblem& p, Epilogue e, bool stream_k, Fn&& fn) {
  if (e == Epilogue::kAffine) {
    if (small_batch(p)) return fn(SmallM{});
    if (stream_k) return fn(WideSK{});
    return fn(Wide{});
  }
  if (stream_k) return fn(TallSK{});
  return fn(Tall{});
}

template <class Fn>
void with_sm90_config(Plan plan, const GemmProblem& p, Epilogue e, int sms, Fn&& fn) {
  const bool sk = prefer_stream_k(p, e, sms);
  using namespace sm90;
  switch (plan) {
    case Plan::kSm90Tf32:
      return pick_config<Tf32Wide, Tf32WideSK, Tf32SmallM, Tf32Tall, Tf32TallSK>(p, e, sk, fn);
    case Plan::kSm90Bf16:
      return pick_config<Bf16Wide, Bf16WideSK, Bf16SmallM, Bf16Tall, Bf16TallSK>(p, e, sk, fn);
    case Plan::kSm90Fp16:
      return pick_config<Fp16Wide, Fp16WideSK, Fp16SmallM, Fp16Tall, Fp16TallSK>(p, e, sk, fn);
    default: throw std::logic_error("epifuse: not a Hopper plan");
  }
}

// Column statistics on Hopper, measured on an H100 (problem 84, BENCHMARKS.md): the fused
// statistics epilogue keeps fp64 sums in registers, which forces 256x64 tiles, and runs at 280
// (TF32) / 577 (bf16) TFLOP/s where the affine kernel's 128x256 tiles reach 409 / 785, and at
// M = 16384 at 137 / 228; at M = 16 .. 512 (stream-K) it took 0.25-0.28 ms for problem 84's
// weights where the affine kernel took 0.15-0.20. Storing z with the affine kernel (a = 1, c = 0)
// and summing it in a separate deterministic fp64 pass costs one more read of z (~9 us at
// 1024x8192 fp32 on an H200) and two more launches, which pays whenever the GEMM is more than a
// few microseconds of work: 2^30 multiply-adds (problem 84 at M = 16), or a grid that fills the
// GPU. Only small GEMMs, where launches dominate, keep the fused kernel.
constexpr double kSeparateStatsMacs = double(1 << 30);

bool stats_as_separate_pass(const GemmProblem& p, Epilogue e, int sms) {
  if (e != Epilogue::kColumnStats) return false;
  const double macs = double(p.M) * double(p.N) * double(p.K);
  return macs >= kSeparateStatsMacs || !prefer_stream_k(p, Epilogue::kAffine, sms);
}

// The separate-pass plan's workspace: a and c (N floats each), then the GEMM's own.
size_t identity_vectors_bytes(const GemmProblem& p) {
  return (2 * sizeof(float) * size_t(p.N) + 255) / 256 * 256;
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

size_t gemm_workspace_bytes(const GemmProblem& p, Epilogue e, int cc_major, int cc_minor) {
  const Plan plan = choose_plan(p, e, nullptr, cc_major, cc_minor);
  if (plan == Plan::kEmpty || plan == Plan::kFallback) return 0;
  size_t bytes = 0;
#if EPIFUSE_HAVE_SM90
  if (is_sm90_plan(plan)) {
    const int device = current_device();
    const int sms = sm_count(device);
    if (stats_as_separate_pass(p, e, sms))
      return identity_vectors_bytes(p) + gemm_workspace_bytes(p, Epilogue::kAffine, cc_major, cc_minor);
    with_sm90_config(plan, p, e, sms, [&](auto cfg) {
      using Config = decltype(cfg);
      if constexpr (Config::kTransposed) {  // affine only (statistics: separate pass, above)
        bytes = sm90::affine_workspace_bytes<Config>(p, device, sms);
      } else {
        bytes = e == Epilogue::kAffine ? sm90::affine_workspace_bytes<Config>(p, device, sms)
                                       : sm90::column_stats_workspace_bytes<Config>(p, device, sms);
      }
    });
    return bytes;
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
  if (plan == Plan::kFallback) {
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
  if (is_sm90_plan(plan)) {
    const int sms = sm_count(device);
    if (stats_as_separate_pass(p, e, sms)) {
      float* ones = static_cast<float*>(workspace);
      float* zeros = ones + p.N;
      fallback::identity_affine(p.N, ones, zeros, stream);
      EpilogueOperands identity;
      identity.a = ones;
      identity.c = zeros;
      gemm_run(p, Epilogue::kAffine, identity,
               static_cast<char*>(workspace) + identity_vectors_bytes(p), device, cc_major,
               cc_minor, stream);
      epilogue_pass(p, e, ops, stream);
      return;
    }
    with_sm90_config(plan, p, e, sms, [&](auto cfg) {
      using Config = decltype(cfg);
      if constexpr (Config::kTransposed) {  // affine only (statistics: separate pass, above)
        sm90::run_affine<Config>(p, ops, workspace, device, sms, stream);
      } else if (e == Epilogue::kAffine) {
        sm90::run_affine<Config>(p, ops, workspace, device, sms, stream);
      } else {
        sm90::run_column_stats<Config>(p, ops, workspace, device, sms, stream);
      }
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
    recompute_nonfinite_rows(p, affine ? ops.a : nullptr, affine ? ops.c : nullptr, stream);
  }
}

}  // namespace epifuse
