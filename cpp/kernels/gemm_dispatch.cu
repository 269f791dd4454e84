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
//   would double the bytes read): cuBLAS's SGEMM, run by the op layer (GemmPlan::host_sgemm), then
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
#include "split_tf32.hpp"
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

// Where 3xTF32 gives way to cuBLAS's SGEMM (both fp32-accurate); the measurements behind the
// three thresholds are in BENCHMARKS.md, "Kernel selection":
//  - below kSplitMinRows rows the GEMM is bound by reading the weight, which the split doubles
//    (hi and lo parts); SGEMM reads it once.
//  - at small K, 3xTF32's error is not clearly below SGEMM's (it drops lo*lo, ~2^-22 per product,
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
      output_aligned(p, e, ops) && split_tf32_ld(p.K) <= INT_MAX)
    return GemmKernelKind::kSm90Split3xTf32;
  if (!vector_aligned(p, e, ops, unit_stride_copies(p))) return GemmKernelKind::kPortable;
  // fp32 3xTF32 here runs the sm80 kernel: no wgmma, or a split too wide for int32 extents.
  if (p.dtype == DType::kFloat32 && p.math == MathMode::k3xTF32) return GemmKernelKind::kSm80;
  return wgmma ? GemmKernelKind::kSm90 : GemmKernelKind::kSm80;
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

// Batches of at most this many rows run the transposed GEMM (Schedule::kSmallM). Below 128 rows the
// 128x256 tile is mostly padding (8x the useful TF32 math at M = 16); up to a few hundred rows its
// 128 tiles or fewer leave stream-K to split the K loop into many partial tiles, where the
// transposed 128x64 tiles are more, smaller units. 384: where the two met on an H200 (BENCHMARKS.md,
// "Kernel selection").
constexpr int64_t kSmallBatchRows = 384;

bool small_batch(const GemmProblem& p) { return p.M <= kSmallBatchRows; }

// The row of the generated table with these keys (-1: none, a hole in generate_kernels.py's table).
int find_sm90_kernel(DType dtype, MathMode math, Epilogue e, sm90::Schedule schedule) {
  for (int i = 0; i < sm90::kKernelCount; ++i) {
    const sm90::KernelInfo& k = sm90::kKernels[i];
    if (k.dtype == dtype && k.math == math && k.epilogue == e && k.schedule == schedule) return i;
  }
  return -1;
}

// The Hopper kernel of a problem (for the split plan: of the split problem, same M and N):
//   small batches: the transposed 128x64 tiles (both epilogues);
//   eval:          the wide tiles over z;
//   training:      the wide tiles over z^T (sm90_gemm_configs.hpp says why);
// each with stream-K when its tiles are fewer than the SMs.
int sm90_kernel(const GemmProblem& p, Epilogue e, int sms) {
  using sm90::Schedule;
  auto find = [&](Schedule s) { return find_sm90_kernel(p.dtype, kernel_math(p), e, s); };
  int kernel = -1;
  if (small_batch(p)) {
    kernel = find(Schedule::kSmallM);
  } else if (e == Epilogue::kAffine) {
    const int wide = find(Schedule::kWide);
    const bool sk = wide >= 0 && prefer_stream_k(p.M, p.N, sm90::kKernels[wide].tile_m,
                                                 sm90::kKernels[wide].tile_n, sms);
    kernel = sk ? find(Schedule::kWideSK) : wide;
  } else {
    const int wide = find(Schedule::kWideTransposed);
    const bool sk = wide >= 0 && prefer_stream_k(p.N, p.M, sm90::kKernels[wide].tile_m,
                                                 sm90::kKernels[wide].tile_n, sms);
    kernel = sk ? find(Schedule::kWideTransposedSK) : wide;
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
  plan.splits_operands = plan.kind == GemmKernelKind::kSm90Split3xTf32;
  if (plan.kind != GemmKernelKind::kEmpty && !plan.splits_operands)
    plan.copies = unit_stride_copies(p);
  // The kernels' workspaces depend on the shape and the GPU, not on the operands' pointers or row
  // strides, so the operand copies leave them as they are.
#if EPIFUSE_HAVE_SM90
  if (plan.kind == GemmKernelKind::kSm90 || plan.splits_operands) {
    plan.sm_count = sm_count(device);
    const GemmProblem gp = plan.splits_operands ? split_problem(p, nullptr, nullptr) : p;
    plan.kernel = sm90_kernel(gp, e, plan.sm_count);
    plan.kernel_name = sm90::kKernels[plan.kernel].name;
    sm90::with_kernel(plan.kernel, [&](auto cfg, auto tag) {
      plan.workspace_bytes =
          sm90_workspace_bytes<decltype(cfg), decltype(tag)>(gp, device, plan.sm_count);
    });
    if (plan.splits_operands) {
      plan.weight_split_bytes = split_tf32_bytes(p.N, p.K);
      plan.workspace_bytes += split_tf32_bytes(p.M, p.K) + row_flag_bytes(p) + plan.weight_split_bytes;
    }
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
  return plan.workspace_bytes - (plan.splits_operands && p.w_split != nullptr ? plan.weight_split_bytes : 0);
}

// TF32 wgmma reads only K-major tiles, so cuBLAS runs an fp32 product with an MN-major operand on a
// slower kernel (it transposes in shared memory). A K-major copy of an operand reads and writes it
// once (8 bytes per element); it pays where that is under a quarter of the product at ~400 TFLOP/s:
// copying x [M, K] costs 8MK bytes against 2MNK flops, i.e. when N >= ~1900 (w [N, K]: when
// M >= ~1900). That keeps problem 84's dX (M = 1024: cuBLAS's MN-major kernel is fast there) and
// copies the rest. The copy must be a tiled transpose (transpose.cu): Tensor::contiguous of the
// transposed views gained nothing. Measurements: BENCHMARKS.md, "Kernel selection".
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

size_t split_weight_floats(const GemmProblem& p) { return size_t(p.N) * size_t(split_tf32_ld(p.K)); }

void split_weight(const GemmProblem& p, float* dst, cudaStream_t stream) {
  split_tf32(static_cast<const float*>(p.w), p.N, p.K, p.ldw, p.w_col_stride, dst, nullptr, stream);
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
  if (ok && plan.kind == GemmKernelKind::kSm90Split3xTf32) {
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
    case GemmKernelKind::kSm90Split3xTf32: {
      // Split x (and w, unless the caller kept its split) into the workspace, then the GEMM on the
      // split operands; its own workspace follows them.
      char* base = static_cast<char*>(workspace);
      auto* x_split = reinterpret_cast<float*>(base);
      base += split_tf32_bytes(p.M, p.K);
      auto* row_flags = reinterpret_cast<int*>(base);
      base += row_flag_bytes(p);
      split_tf32(static_cast<const float*>(p.x), p.M, p.K, p.ldx, p.x_col_stride, x_split,
                 row_flags, stream);
      const float* w_split = p.w_split;
      if (w_split == nullptr) {
        split_weight(p, reinterpret_cast<float*>(base), stream);
        w_split = reinterpret_cast<const float*>(base);
        base += plan.weight_split_bytes;
      }
      const GemmProblem sp = split_problem(p, x_split, w_split);
      sm90::with_kernel(plan.kernel, [&](auto cfg, auto tag) {
        sm90_run<decltype(cfg), decltype(tag)>(sp, ops, base, plan.device, plan.sm_count, stream);
      });
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
