// epifuse kernel API: everything the op layer may call.
//
// This header is deliberately free of torch (and of CUTLASS): raw pointers, sizes and a
// cudaStream_t. The CUTLASS translation units behind it are the slow part of the build, so
// they never see a torch header and can be compiled once, independently of the torch version.
//
// Errors: launchers throw std::runtime_error on a failed launch or an internal invariant; the
// op layer validates user input before calling, so user errors never reach this level.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace epifuse {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// How a GEMM multiplies. kIEEE: exact fp32 products (FFMA); kTF32: fp32 inputs on the tensor cores
// with TF32 operands; k3xTF32: fp32 inputs split into big + small parts, three tensor-core
// products (small*big + big*small + big*big), fp32 accuracy: on Hopper the parts are row-scaled
// FP16 (split_fp16.cu) and the tensor-core sums are promoted to fp32 registers
// (sm90_mainloop_3x.hpp), on sm80 they are TF32 (CUTLASS's OpMultiplyAddFastF32); the mode keeps
// the name the precision setting has ('3xtf32'). kNative: 16-bit inputs on the tensor cores.
// Accumulation is fp32 always.
enum class MathMode { kIEEE, kTF32, k3xTF32, kNative };

// ---- what this build can run -------------------------------------------------------------------
// Comma-separated GPU architectures the kernels were compiled for (CMake's EPIFUSE_ARCHS), e.g.
// "80,90a".
const char* built_archs();

// Whether the kernels can run on a GPU of compute capability major.minor: an "XY" build runs on
// X.Y and later minors of the same major (sm_80 code on sm_86 / sm_89); "XYa" only on X.Y.
bool supports_device(int cc_major, int cc_minor);

// What the GEMM epilogue does with the fp32 accumulator acc[m, n] = sum_k x[m, k] * w[n, k].
enum class Epilogue {
  kAffine,       // out[m, n] = act(a[n] * acc + c[n]), act the head's activation (none: identity)
  kColumnStats,  // out[m, n] = z = acc (rounded to out's dtype); colsum[n] = sum_m z,
                 // colsumsq[n] = sum_m z^2 (fp64): the statistics of z as stored
};

struct GemmProblem {
  int64_t M = 0, N = 0, K = 0;
  const void* x = nullptr;  int64_t ldx = 0;  // [M, K], row stride ldx, unit column stride
  const void* w = nullptr;  int64_t ldw = 0;  // [N, K] (nn.Linear weight), row stride ldw
  void* out = nullptr;      int64_t ldo = 0;  // [M, N], row stride ldo
  // Column strides of x and w. Only plans that split their operands (GemmPlan::splits_operands)
  // read strided columns (e.g. the transposed views of the backward's GEMMs); the others ask for
  // K-major copies (GemmPlan::copies).
  int64_t x_col_stride = 1, w_col_stride = 1;
  DType dtype = DType::kFloat32;              // of x, w and out alike
  MathMode math = MathMode::kTF32;
  // Optional, for plans that split their operands (GemmPlan::splits_operands): w already split
  // (split_weight below), e.g. cached while the weight is unchanged; null: the GEMM splits w into
  // its workspace.
  const void* w_split = nullptr;
  // Set by split plans on the problem their GEMM runs (x and w then point at split parts): the
  // scale exponents of x's rows and w's rows (split_fp16.hpp), which the epilogue applies.
  const float* x_exponents = nullptr;
  const float* w_exponents = nullptr;
};

// ---- The activation of a head: after the per-column affine, before the softmax ----------------
// act(h) in fp32, as PyTorch's (cpp/kernels/activation.cuh; python/epifuse/fold.py's activate()
// is the reference). The ops name them by HeadConfig's 'activation' strings.
enum class ActivationKind : int { kNone, kReLU, kLeakyReLU, kGELU, kGELUTanh, kSiLU };
struct Activation {
  ActivationKind kind = ActivationKind::kNone;
  float negative_slope = 0.01f;  // kLeakyReLU only
};

struct EpilogueOperands {
  const float* a = nullptr;   // kAffine: [N]
  const float* c = nullptr;   // kAffine: [N]
  Activation act;             // kAffine: out = act(a[n] * acc + c[n]) (eval heads)
  double* colsum = nullptr;   // kColumnStats: [N]
  double* colsumsq = nullptr; // kColumnStats: [N]
};

// ---- GEMM planning ----------------------------------------------------------------------------
// A GEMM runs in CUTLASS's order: arguments -> workspace size -> can_implement -> run. gemm_plan
// decides everything once (gemm_plan.cu is the only place with shape heuristics); the workspace
// query and the launch (gemm_run.cu) take its plan and decide nothing, so they cannot disagree.

// Which kernels a plan runs.
enum class GemmKernelKind {
  kEmpty,            // no output elements: nothing to multiply (column statistics are zeroed)
  kPortable,         // the SIMT GEMM writing z, then the epilogue as its own pass (any alignment)
  kHostSgemm,        // cuBLAS's SGEMM, run by the op layer, then epilogue_pass (gemm_run: kPortable)
  kSm90,             // one Hopper TMA + wgmma GEMM with the epilogue fused (TF32, 16-bit)
  kSm90Split3x,      // the operands split into FP16 hi/lo parts, then the Hopper 3x GEMM
  kSm80,             // one CUTLASS 2.x mma.sync GEMM with the epilogue fused (TF32, 3xTF32, 16-bit)
};

// Operands to copy into K-major rows (unit column stride) before a launch; see GemmPlan.
struct KMajorCopies {
  bool x = false, w = false;
  // cublas_tf32_k_major_copies only: copy w (and multiply) in chunks of this many rows, so that
  // the copy of a large operand never exists whole; 0: all rows at once.
  int64_t w_chunk = 0;
};

struct GemmPlan {
  GemmKernelKind kind = GemmKernelKind::kEmpty;
  // The tile configuration of kSm90 / kSm90Split3x / kSm80: a row of the generated kernel table
  // (generate_kernels.py), named for logs; -1 and "" for the other kinds.
  int kernel = -1;
  const char* kernel_name = "";
  // kind == kHostSgemm: the op layer runs cuBLAS's SGEMM (IEEE fp32) before epilogue_pass; chosen
  // for IEEE math, and for 3xTF32 problems too small to gain from the split.
  bool host_sgemm = false;
  // kind == kSm90Split3x: the GEMM multiplies operands split into FP16 hi/lo parts. It reads
  // x and w with any strides; p.w_split may carry a split made ahead of time (split_weight below).
  bool splits_operands = false;
  // Every other plan reads rows with unit column stride: the caller replaces an operand marked here
  // by a row-major copy in a fresh allocation (16-byte aligned, row stride K) before the launch.
  // The plan was made for those copies.
  KMajorCopies copies;
  // Device workspace bytes of the launch when it splits w itself (p.w_split null): the split of a
  // chunk of x's rows (and x's non-finite row flags), the split of a chunk of w's rows
  // (weight_split_bytes) and the GEMM's own workspace. A launch given p.w_split needs
  // workspace_bytes_given_split. gemm_workspace_bytes says which.
  size_t workspace_bytes = 0;
  size_t weight_split_bytes = 0;
  size_t workspace_bytes_given_split = 0;
  // Split plans split x in chunks of x_chunk rows (the output's rows; the affine epilogue only) and
  // w in chunks of w_chunk rows (the output's columns), one GEMM per pair of chunks (chunk_kernel,
  // the tile configuration for that shape), so that the split of a large operand never exists whole
  // (the split of problem 84's 8192x8192 weight is 256 MiB). Given p.w_split, the GEMMs
  // (kernel) read it over all of N. x_chunk == M, w_chunk == N: one chunk.
  int64_t x_chunk = 0, w_chunk = 0;
  int chunk_kernel = -1;
  // What the plan was made for (gemm_run checks that the launch matches).
  int64_t M = 0, N = 0, K = 0;
  DType dtype = DType::kFloat32;
  MathMode math = MathMode::kTF32;
  Epilogue epilogue = Epilogue::kAffine;
  int device = 0, sm_count = 0;
};

// The plan for p (its shapes, dtype, math, operand pointers and strides) with epilogue e on
// `device` (compute capability device_cc_major.device_cc_minor, the current device). The epilogue's
// vectors (ops: a, c or colsum, colsumsq) are inputs too: the fused epilogues read them as 16-byte
// vectors, so a misaligned one gives a plan that applies the epilogue as a separate pass.
GemmPlan gemm_plan(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops, int device,
                   int device_cc_major, int device_cc_minor);

// Device workspace bytes the launch of `plan` on p needs (0 when none): plan.workspace_bytes, less
// the weight split when p.w_split carries one. Allocate with any allocator, 16-byte aligned.
size_t gemm_workspace_bytes(const GemmPlan& plan, const GemmProblem& p);

// Runs the planned GEMM and its epilogue on `stream`. p is the planned problem with the operand
// copies the plan asked for bound in, and p.w_split when the plan splits; ops are the planned
// epilogue vectors; `workspace` holds gemm_workspace_bytes(plan, p) bytes. Throws
// std::invalid_argument when p or ops are not what the plan was made for.
void gemm_run(const GemmPlan& plan, const GemmProblem& p, const EpilogueOperands& ops,
              void* workspace, cudaStream_t stream);

// For a product the op layer runs on cuBLAS in TF32 (the backward's dX = dZ . W, dW = dZ^T . X):
// which of x, w (strided views, x_col_stride / w_col_stride != 1 where MN-major) to copy K-major
// first, because the copy costs less than the slower kernel cuBLAS takes for that layout; and in
// how many rows of w at a time (w_chunk), the output's columns then written chunk by chunk.
KMajorCopies cublas_tf32_k_major_copies(const GemmProblem& p, int device_cc_major, int device_cc_minor);

// In place over n contiguous floats of an fp32 product of fp16 operands: +-inf
// wherever the fp16 product would have overflowed (|v| >= 65520), everything else unchanged.
void fp16_overflow_(float* p, int64_t n, cudaStream_t stream);

// out [M, N] fp32 (row stride ldo) = a [M, K] . b [K, N] from fp16 operands, +-inf wherever the
// fp16 product would have overflowed (fp16_overflow_'s values): the backward's dX / dW under fp16
// autocast. a's element (m, k) is at a[m * a_stride_m + k * a_stride_k], one of the two strides 1;
// b is row-major (row stride ldb).
struct Fp16Product {
  int64_t M = 0, N = 0, K = 0;
  const void* a = nullptr;
  int64_t a_stride_m = 0, a_stride_k = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  float* out = nullptr;
  int64_t ldo = 0;
};

// How an Fp16Product runs (fp16_product_plan.cu decides): on the Hopper GEMM whose epilogue applies
// the overflow (sm90_fp16_product.cu) where the build, the device and TMA's alignment allow it,
// with workspace_bytes of workspace; otherwise (hopper false) the caller runs cuBLAS's fp32
// product, then fp16_overflow_ over it.
struct Fp16ProductPlan {
  bool hopper = false;
  size_t workspace_bytes = 0;
  int device = 0, sm_count = 0;
};
Fp16ProductPlan plan_fp16_product(const Fp16Product& p, int device, int cc_major, int cc_minor);
void run_fp16_product(const Fp16ProductPlan& plan, const Fp16Product& p, void* workspace,
                      cudaStream_t stream);
namespace sm90 {  // sm90_fp16_product.cu (built with the Hopper kernels)
bool fp16_product_can_implement(const Fp16Product& p, int device, int sm_count);
size_t fp16_product_workspace_bytes(const Fp16Product& p, int device, int sm_count);
void run_fp16_product(const Fp16Product& p, void* workspace, int device, int sm_count,
                      cudaStream_t stream);
}  // namespace sm90

// dst[i] = src[i] rounded to dst_dtype (bf16 or fp16) for n contiguous fp32 elements, as
// Tensor::to rounds (narrowing_cast.cu: the 16-bit GEMM operands under autocast).
void narrowing_cast(const float* src, void* dst, int64_t n, DType dst_dtype, cudaStream_t stream);

// dst [rows, cols] (row stride ld_dst) = src^T, src [cols, rows] (row stride ld_src): dst[r, c] =
// src[c, r]. E.g. a row-major copy of a column-major view (a K-major copy of an MN-major operand).
void transpose(const void* src, int64_t ld_src, void* dst, int64_t ld_dst, int64_t rows,
               int64_t cols, DType dtype, cudaStream_t stream);

// The weight of a problem whose plan splits its operands (p.w, p.N, p.K, p.ldw, p.w_col_stride)
// split into dst, split_weight_bytes(p) bytes (256-byte aligned); the caller may keep it as
// p.w_split while the weight is unchanged.
size_t split_weight_bytes(const GemmProblem& p);
void split_weight(const GemmProblem& p, void* dst, cudaStream_t stream);

// Applies the epilogue to a product already stored in p.out (computed by another GEMM, e.g. cuBLAS):
// kAffine rewrites it in place, kColumnStats reads it into colsum / colsumsq.
void epilogue_pass(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops, cudaStream_t stream);

// ---- BatchNorm fold: per-column (a, c) from statistics and parameters -------------------------
// Parameter vectors share one dtype (the model's); scales have numel 1 or N; any pointer marked
// optional may be null. See python/epifuse/fold.py, the reference for this math.
struct FoldProblem {
  int64_t N = 0;
  DType param_dtype = DType::kFloat32;
  const void* bias = nullptr;        // optional [N]
  const void* gamma = nullptr;       // [N]
  const void* beta = nullptr;        // [N]
  const void* pre_scale = nullptr;   // optional, numel pre_scale_numel
  int64_t pre_scale_numel = 0;
  const void* post_scale = nullptr;  // optional, numel post_scale_numel
  int64_t post_scale_numel = 0;
  double eps = 1e-5;
  float* a = nullptr;                // out [N]
  float* c = nullptr;                // out [N]
};

// Training: batch statistics from colsum/colsumsq over `count` rows; updates the running statistics
// in place (running_mean/var in param dtype, num_batches_tracked int64) and writes the batch's
// moments as bn_fold_batch does (the backward's input), all in one kernel. momentum < 0 means None
// (cumulative average).
void bn_fold_train(const FoldProblem& f, const double* colsum, const double* colsumsq, int64_t count,
                   void* running_mean, void* running_var, int64_t* num_batches_tracked,
                   double momentum, double* moments, cudaStream_t stream);

// Eval: running statistics (read only) in the parameters' dtype, or float64 (stats_fp64: the
// moments a backward kept, folded without casting them first).
void bn_fold_eval(const FoldProblem& f, const void* running_mean, const void* running_var,
                  bool stats_fp64, cudaStream_t stream);

// Training without the running-statistics update (the differentiable forward, whose op must not
// mutate its inputs): (a, c) as bn_fold_train, and moments[0:N] = batch mean of u,
// moments[N:2N] = its biased variance, moments[2N] = count (fp64 [2N + 1]; the backward's input).
void bn_fold_batch(const FoldProblem& f, const double* colsum, const double* colsumsq,
                   int64_t count, double* moments, cudaStream_t stream);

// The running-statistics update alone, from such moments (fp64 [2N + 1]; a synchronized batch's merged
// moments too): as bn_fold_train's, in place, the count read on the device. momentum < 0 means None.
void update_running_stats(int64_t N, DType stats_dtype, const double* moments, void* running_mean,
                          void* running_var, int64_t* num_batches_tracked, double momentum,
                          cudaStream_t stream);

// ---- Row passes over an [M, N] matrix with row stride ld ---------------------------------------
// Row passes read `in` in in_dtype and write `out` in out_dtype: the same dtype, or a 16-bit input
// with an fp32 output (autocast: z in the GEMM's 16-bit dtype, the head's output in fp32).

// out = softmax(act(a[n] * in + c[n])) along each row; a, c may be null (identity). in may equal
// out (same dtype).
void affine_softmax(DType in_dtype, int64_t M, int64_t N, const void* in, int64_t ld_in,
                    DType out_dtype, void* out, int64_t ld_out, const float* a, const float* c,
                    Activation act, cudaStream_t stream);

// z = act(a[n] * z + c[n]) in place (the GEMM's affine epilogue run as a separate pass); a, c may
// be null (the activation alone).
void column_affine(DType dtype, int64_t M, int64_t N, void* z, int64_t ld, const float* a,
                   const float* c, Activation act, cudaStream_t stream);

// out = act(a[n] * in[m, n] + c[n]) (in may equal out, same dtype); a, c may be null (identity).
void column_affine_into(DType in_dtype, int64_t M, int64_t N, const void* in, int64_t ld_in,
                        DType out_dtype, void* out, int64_t ld_out, const float* a, const float* c,
                        Activation act, cudaStream_t stream);

// ---- Backward of a head (python/epifuse/fold.py, "backward", is the reference) -----------------
// g = grad of the head's output; out = the softmax's output (softmax heads); z = x . W^T as the
// forward's GEMM stored it; all [M, N] with unit column stride and row strides ld_g / ld_out / ld_z.
// g and out share `dtype` (the head's output dtype); z has z_dtype, the same or (autocast) a 16-bit
// GEMM dtype under an fp32 output. dv = out * (g - rowdot[m]) for softmax heads (out non-null),
// else g; times act'(a[n] * z + c[n]) for a head with an activation.
struct GradOperands {
  DType dtype = DType::kFloat32;    // g, out
  DType z_dtype = DType::kFloat32;  // z (and dz, head_grad_z's output)
  int64_t M = 0, N = 0;
  const void* g = nullptr;    int64_t ld_g = 0;
  const void* out = nullptr;  int64_t ld_out = 0;  // null: no softmax
  const float* rowdot = nullptr;                   // [M], softmax heads
  const void* z = nullptr;    int64_t ld_z = 0;
  // A head with an activation: dv is also multiplied by act'(h), h = a[n] * z + c[n] (the
  // forward's fold, fp32 [N]); a, c null without one.
  Activation act;
  const float* a = nullptr;
  const float* c = nullptr;
};

// rowdot[m] = sum_n g[m, n] * out[m, n] (fp32 accumulation, fixed order).
void softmax_grad_rowdot(const GradOperands& o, float* rowdot, cudaStream_t stream);

// sums[0:N] = S1 = sum_m dv, sums[N:2N] = S3 = sum_m dv * z (fp64; each column's rows reduced in
// splits of rows by one block each, in a fixed order, then the splits by sum_tile_partials, in its
// fixed order: deterministic), sums[2N] = M. scratch: head_grad_sums_scratch_bytes(o) bytes (the splits'
// partials; null when 0). Launches nothing when N == 0.
size_t head_grad_sums_scratch_bytes(const GradOperands& o);
void head_grad_sums(const GradOperands& o, double* sums, void* scratch, cudaStream_t stream);

// Per-column coefficients of dz = A * dv + B * z + C and the parameter gradients, from the sums.
struct GradCoefficientProblem {
  FoldProblem params;                   // N, dtype, bias / gamma / beta / scales, eps (a, c unused)
  bool training = true;
  const double* sums = nullptr;         // [2N + 1], this batch's head_grad_sums
  const double* global_sums = nullptr;  // [2N + 1]: fold.normalized_grad_sums over all ranks
                                        // (synchronized BatchNorm); null: this batch is all
  const double* colsum = nullptr;       // [N] this batch's sum of z (training)
  const double* colsumsq = nullptr;     // [N] this batch's sum of z^2 (training)
  const double* moments = nullptr;      // [2N + 1]: mean, biased var of u BatchNorm normalized with
  float* coef = nullptr;                // out [3, N]: A, B, C
  void* grad_bias = nullptr;            // out, param dtype [N] (null when bias is)
  void* grad_gamma = nullptr;           // out [N]
  void* grad_beta = nullptr;            // out [N]
  void* grad_pre = nullptr;             // out, numel pre_scale_numel (null when pre_scale is)
  void* grad_post = nullptr;            // out, numel post_scale_numel (null when post_scale is)
  // Set by head_grad_coefficients from its scratch (a one-element scale's sum over the columns).
  double* scale_partials = nullptr;
  unsigned* blocks_done = nullptr;
};
// Device scratch the launch needs (0: none): a one-element scale's gradient is summed over the
// column blocks through it. It need not be zeroed: the launch clears the block counter in it first.
size_t head_grad_coefficients_scratch_bytes(const FoldProblem& params);
void head_grad_coefficients(const GradCoefficientProblem& p, void* scratch, cudaStream_t stream);

// dz[m, n] = A[n] * dv + B[n] * z + C[n] in z's dtype (row stride ld_dz), coef = [A; B; C].
void head_grad_z(const GradOperands& o, const float* coef, void* dz, int64_t ld_dz,
                 cudaStream_t stream);

}  // namespace epifuse
