// Argument checks and error messages shared by the op files (gemm.cpp, fold.cpp, apply.cpp,
// backward.cpp, synced.cpp, head.cpp): they validate an op's tensors the way PyTorch's own ops do
// (same exception types, messages naming the argument) into the launchers' structs of
// epifuse/kernels.h.
//
// The checks are the only ones: they hold for every device. An op checks its arguments first, then
// runs its CUDA kernels, or, for CPU tensors, the float64 reference (EPIFUSE_REFERENCE, dispatch.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>
#include <vector>
#include <string>
#include <tuple>
#include <utility>

#include "epifuse/kernels.h"

namespace epifuse {

// ---- error messages --------------------------------------------------------------------------
// Messages are assembled from std::string pieces, never through iostreams: c10::str's
// std::ostringstream would be instantiated in this library, and a stream built here with one
// libstdc++ and used with another (the host compiler's headers vs. the process's runtime) crashed
// while formatting an integer (seen on the Hopper image: GCC 13 headers, torch's runtime).
inline void append(std::string& out, const char* piece) { out += piece; }
inline void append(std::string& out, const std::string& piece) { out += piece; }
inline void append(std::string& out, int64_t v) { out += std::to_string(v); }
inline void append(std::string& out, int v) { out += std::to_string(v); }
inline void append(std::string& out, double v) { out += std::to_string(v); }
inline void append(std::string& out, const c10::Device& d) { out += d.str(); }
inline void append(std::string& out, c10::ScalarType t) { out += c10::toString(t); }
inline void append(std::string& out, at::IntArrayRef sizes) {
  out += "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  out += "]";
}

template <class... Pieces>
std::string cat(const Pieces&... pieces) {
  std::string out;
  (append(out, pieces), ...);
  return out;
}

#define EPIFUSE_CHECK(cond, ...) TORCH_CHECK(cond, ::epifuse::cat(__VA_ARGS__))
#define EPIFUSE_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::epifuse::cat(__VA_ARGS__))

// The kernels' dtype of a tensor (Float, Half or BFloat16; anything else: "not implemented").
DType to_dtype(const at::Tensor& t, const char* op);

// t (argument `name` of `op`) is on ref's device (a CUDA or a CPU tensor).
void check_device(const at::Tensor& t, const char* op, const char* name, const at::Tensor& ref);

// ---- settings -------------------------------------------------------------------------------

// The fp32 GEMM precisions the ops take ("ieee", "3xtf32", "tf32"), in the order
// epifuse::precision_names lists them (python/epifuse/precision.py reads them from there).
std::vector<std::string> precision_names();

// The GEMMs' math for `precision` and operands of `dtype` (16-bit: their native MMA, whatever the
// precision; float32: the precision, which must be one of precision_names()).
MathMode math_mode(const std::string& precision, DType dtype, const char* op);

// HeadConfig's activation by name ('', 'relu', 'leaky_relu', 'gelu', 'gelu_tanh', 'silu').
Activation activation_from_name(c10::string_view name, double negative_slope, const char* op);

// ---- shared tensor checks ---------------------------------------------------------------------

// A per-column fp32 vector of length n on ref's device, contiguous (a copy only for a view).
at::Tensor column_vector(const at::Tensor& v, int64_t n, const char* op, const char* name,
                         const at::Tensor& ref);

// A 2-D tensor in a kernel dtype (the row passes' z).
void check_matrix(const at::Tensor& z, const char* op);

// The product x [M, K] . w [N, K]^T: 2-D operands on one device, of one kernel dtype, agreeing on
// K, and a precision the dtype takes (at::mm's messages for the dtype and shape mismatches).
void check_gemm_operands(const at::Tensor& x, const at::Tensor& w, const std::string& precision,
                         const char* op);

// Row-major with unit column stride: what the kernels take without a copy.
at::Tensor rows_with_unit_stride(const at::Tensor& t);

// Compute capability of a device, queried once (the kernels dispatch on it).
std::pair<int, int> compute_capability(int device);

// Makes t's device current for the op. Checks first that t is a CUDA tensor (a guard built from
// a CPU device is undefined behaviour in release builds of c10) and that this build has kernels
// for its GPU (else every launch would fail with "no kernel image is available").
c10::cuda::CUDAGuard guard_for(const at::Tensor& t, const char* op, const char* name);

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// An op's output or scratch on the CUDA device of `options`, uninitialized (the kernels write all
// of it, and zero what they accumulate into): taken from the caching allocator directly rather
// than through at::empty, whose dispatch (BackendSelect, then the CUDA kernel) is host time on
// every call, and the ops allocate ~60 tensors in a training step of a three-head model. ATen's
// structured CUDA kernels allocate their outputs the same way (create_out). (Unlike at::empty it
// does not fill with NaN under torch.use_deterministic_algorithms: no byte of these is read
// before a kernel writes it.)
inline at::Tensor new_cuda(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::detail::empty_cuda(sizes, options);
}

// t.to(dtype) for a GEMM operand cast under autocast. An fp32 CUDA tensor narrowed to bf16 or
// fp16, contiguous, on a GPU this build has kernels for: a fresh tensor and one narrowing_cast
// launch, without aten::to's dispatch and TensorIterator (narrowing_cast.cu says why). Anything
// else: t.to(dtype).
at::Tensor to_gemm_dtype(const at::Tensor& t, at::ScalarType dtype);

// A parameter vector of a fold (argument `name` of `op`): on like's device and in its dtype
// (like_name names it in the message), contiguous, [N] or, for a scale, 1 or N elements.
void check_fold_param(const at::Tensor& t, const char* name, bool scale, int64_t N,
                      const at::Tensor& like, const char* like_name, const char* op);

// Validates the parameter vectors (one dtype, on one device, contiguous) into a FoldProblem.
// (Its pointers are bound for any device; only a CUDA op launches with them.)
FoldProblem prepare_fold(const std::optional<at::Tensor>& bias, const at::Tensor& gamma,
                         const at::Tensor& beta, const std::optional<at::Tensor>& pre_scale,
                         const std::optional<at::Tensor>& post_scale, double eps, const char* op);

// The fold's outputs (a, c: float32 [N] on gamma's CUDA device), bound into f.
std::tuple<at::Tensor, at::Tensor> fold_outputs(const at::Tensor& gamma, FoldProblem& f);

// An in-place op's input `read_name` shares no memory with the tensor it writes: a kernel reading
// a or c while writing z would race. PyTorch's in-place ops refuse the same
// (at::assert_no_partial_overlap); here any byte both spans hold counts, a full overlap included.
void check_written_apart(const at::Tensor& written, const std::optional<at::Tensor>& read,
                         const char* op, const char* written_name, const char* read_name);

// t is a contiguous float64 [numel] tensor on ref's device (column sums, moments, rows of sums).
void check_sums(const at::Tensor& t, const char* name, int64_t numel, const at::Tensor& ref,
                const char* op);

}  // namespace epifuse
