// The argument checks shared by the op files (op_args.h says what each does).
#include "op_args.h"

#include <algorithm>
#include <array>
#include <iterator>

namespace epifuse {

DType to_dtype(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      EPIFUSE_CHECK(false, "epifuse::", op, " not implemented for '", t.scalar_type(),
                  "' (expected Float, Half or BFloat16)");
  }
  return DType::kFloat32;  // unreachable
}

void check_device(const at::Tensor& t, const char* op, const char* name, const at::Tensor& ref) {
  EPIFUSE_CHECK(t.device() == ref.device(),
              "Expected all tensors to be on the same device, but found at least two devices, ",
              ref.device(), " and ", t.device(), "! (epifuse::", op, ", argument ", name, ")");
}

// ---- settings -------------------------------------------------------------------------------

namespace {

// The fp32 GEMM precisions, the one place that names them.
constexpr std::pair<const char*, MathMode> kPrecisions[] = {
    {"ieee", MathMode::kIEEE}, {"3xtf32", MathMode::k3xTF32}, {"tf32", MathMode::kTF32}};

// "'ieee', '3xtf32' or 'tf32'", or with `last` as the last choice.
std::string quoted_precisions(const char* last = nullptr) {
  std::string out;
  const size_t n = std::size(kPrecisions);
  for (size_t i = 0; i < n; ++i) {
    out += i == 0 ? "" : (i + 1 == n && last == nullptr ? " or " : ", ");
    out = out + "'" + kPrecisions[i].first + "'";
  }
  return last != nullptr ? out + " or " + last : out;
}

// HeadConfig's activation names, the one place that spells them (python/epifuse/fold.py's
// ACTIVATIONS lists the same, in this order; tests check they agree).
constexpr std::pair<const char*, ActivationKind> kActivations[] = {
    {"", ActivationKind::kNone},                {"relu", ActivationKind::kReLU},
    {"leaky_relu", ActivationKind::kLeakyReLU}, {"gelu", ActivationKind::kGELU},
    {"gelu_tanh", ActivationKind::kGELUTanh},   {"silu", ActivationKind::kSiLU}};

}  // namespace

std::vector<std::string> precision_names() {
  std::vector<std::string> names;
  for (const auto& entry : kPrecisions) names.emplace_back(entry.first);
  return names;
}

MathMode math_mode(const std::string& precision, DType dtype, const char* op) {
  const auto* known = std::find_if(std::begin(kPrecisions), std::end(kPrecisions),
                                   [&](const auto& entry) { return precision == entry.first; });
  EPIFUSE_CHECK_VALUE(known != std::end(kPrecisions) || precision.empty(), "epifuse::", op,
                      ": precision must be ", quoted_precisions("'' (16-bit inputs)"), ", got '",
                      precision, "'");
  if (dtype != DType::kFloat32) return MathMode::kNative;
  EPIFUSE_CHECK_VALUE(!precision.empty(), "epifuse::", op, ": float32 inputs need precision ",
                      quoted_precisions());
  return known->second;
}

Activation activation_from_name(c10::string_view name, double negative_slope, const char* op) {
  for (const auto& entry : kActivations) {
    if (name == entry.first) return Activation{entry.second, float(negative_slope)};
  }
  EPIFUSE_CHECK_VALUE(false, "epifuse::", op, ": unknown activation '", std::string(name),
                      "' (expected '', 'relu', 'leaky_relu', 'gelu', 'gelu_tanh' or 'silu')");
  return {};
}

// ---- shared tensor checks ---------------------------------------------------------------------

at::Tensor column_vector(const at::Tensor& v, int64_t n, const char* op, const char* name,
                         const at::Tensor& ref) {
  check_device(v, op, name, ref);
  EPIFUSE_CHECK(v.scalar_type() == at::kFloat, "epifuse::", op, ": expected ", name,
                " to be float32, got ", v.scalar_type());
  EPIFUSE_CHECK(v.dim() == 1 && v.size(0) == n, "epifuse::", op, ": expected ", name,
                " of shape [", n, "], got ", v.sizes());
  return v.contiguous();
}

void check_matrix(const at::Tensor& z, const char* op) {
  EPIFUSE_CHECK(z.dim() == 2, "epifuse::", op, ": expected a 2-D tensor, got ", z.dim(), "-D");
  to_dtype(z, op);
}

void check_gemm_operands(const at::Tensor& x, const at::Tensor& w, const std::string& precision,
                         const char* op) {
  EPIFUSE_CHECK(x.dim() == 2, "epifuse::", op, ": expected x to be 2-D [M, K], got ", x.dim(),
                "-D");
  EPIFUSE_CHECK(w.dim() == 2, "epifuse::", op, ": expected weight to be 2-D [N, K], got ",
                w.dim(), "-D");
  check_device(w, op, "weight", x);
  EPIFUSE_CHECK(x.scalar_type() == w.scalar_type(),
                "mat1 and mat2 must have the same dtype, but got ", x.scalar_type(), " and ",
                w.scalar_type());
  EPIFUSE_CHECK(x.size(1) == w.size(1), "mat1 and mat2 shapes cannot be multiplied (", x.size(0),
                "x", x.size(1), " and ", w.size(1), "x", w.size(0), ")");
  math_mode(precision, to_dtype(x, op), op);
}

at::Tensor rows_with_unit_stride(const at::Tensor& t) {
  const bool ok = t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(t.size(1), 1);
  return ok ? t : t.contiguous();
}

// ---- devices ----------------------------------------------------------------------------------

std::pair<int, int> compute_capability(int device) {
  static std::array<std::pair<int, int>, 128> cache{};  // benign race: writers agree
  EPIFUSE_CHECK(device >= 0 && device < int(cache.size()), "epifuse: unsupported device index ", device);
  if (cache[device].first == 0) {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    cache[device] = {major, minor};
  }
  return cache[device];
}

namespace {

// Whether this build has kernels for a device's GPU, decided once per device (every op asks).
bool device_supported(int device) {
  static std::array<int8_t, 128> cache{};  // 0: not asked yet, 1: yes, -1: no; writers agree
  int8_t& known = cache[device];           // compute_capability() checked the index
  if (known == 0) {
    const auto [major, minor] = compute_capability(device);
    known = supports_device(major, minor) ? 1 : -1;
  }
  return known > 0;
}

}  // namespace

c10::cuda::CUDAGuard guard_for(const at::Tensor& t, const char* op, const char* name) {
  EPIFUSE_CHECK(t.is_cuda(), "epifuse::", op, ": expected ", name, " to be a CUDA tensor, got ",
              t.device());
  const auto [major, minor] = compute_capability(t.get_device());
  EPIFUSE_CHECK(device_supported(t.get_device()), "epifuse::", op, ": this library has no kernels for ",
              t.device(), " (sm_", major, minor, "); it was built for ", built_archs(),
              ". Rebuild with -DEPIFUSE_ARCHS=", major, minor, " (CMake) to add it.");
  return c10::cuda::CUDAGuard(t.device());
}

at::Tensor to_gemm_dtype(const at::Tensor& t, at::ScalarType dtype) {
  const bool narrowing = t.scalar_type() == at::kFloat &&
                         (dtype == at::kBFloat16 || dtype == at::kHalf);
  // A tensor with CUDA memory behind it: torch.compile traces this op's autograd and autocast
  // kernels with FakeTensors (the Python key) and functional wrappers, whose data is not there to
  // read; they, and any other subclass, take aten::to.
  static const c10::DispatchKeySet plain_cuda =
      c10::DispatchKeySet({c10::DispatchKey::CUDA, c10::DispatchKey::AutogradCUDA,
                           c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCUDA});
  if (!narrowing || !t.is_cuda() || !plain_cuda.isSupersetOf(t.key_set()) ||
      !t.is_contiguous() || !device_supported(t.get_device())) {
    return t.to(dtype);
  }
  const c10::cuda::CUDAGuard guard(t.device());
  // t's strides, as Tensor.to keeps them (a contiguous tensor's size-1 dimensions may have any).
  at::Tensor out = at::detail::empty_strided_cuda(t.sizes(), t.strides(), t.options().dtype(dtype));
  narrowing_cast(t.data_ptr<float>(), out.data_ptr(), t.numel(),
                 dtype == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16, current_stream());
  return out;
}

void check_fold_param(const at::Tensor& t, const char* name, bool scale, int64_t N,
                      const at::Tensor& like, const char* like_name, const char* op) {
  check_device(t, op, name, like);
  EPIFUSE_CHECK(t.scalar_type() == like.scalar_type(), "epifuse::", op, ": expected ", name,
                " to have dtype ", like.scalar_type(), " like ", like_name, ", got ", t.scalar_type());
  EPIFUSE_CHECK(t.is_contiguous(), "epifuse::", op, ": expected ", name, " to be contiguous");
  if (scale) {
    EPIFUSE_CHECK(t.numel() == 1 || (t.dim() == 1 && t.numel() == N), "epifuse::", op,
                  ": expected ", name, " to have 1 or ", N, " elements (one per column), got shape ",
                  t.sizes());
  } else {
    EPIFUSE_CHECK(t.dim() == 1 && t.numel() == N, "epifuse::", op, ": expected ", name,
                  " of shape [", N, "], got ", t.sizes());
  }
}

FoldProblem prepare_fold(const std::optional<at::Tensor>& bias, const at::Tensor& gamma,
                         const at::Tensor& beta, const std::optional<at::Tensor>& pre_scale,
                         const std::optional<at::Tensor>& post_scale, double eps, const char* op) {
  EPIFUSE_CHECK(gamma.dim() == 1, "epifuse::", op, ": expected gamma to be 1-D, got ", gamma.sizes());
  const int64_t N = gamma.size(0);
  auto check_param = [&](const at::Tensor& t, const char* name, bool scale) {
    check_fold_param(t, name, scale, N, gamma, "gamma", op);
  };
  check_param(gamma, "gamma", false);
  check_param(beta, "beta", false);
  if (bias) check_param(*bias, "bias", false);
  if (pre_scale) check_param(*pre_scale, "pre_scale", true);
  if (post_scale) check_param(*post_scale, "post_scale", true);
  EPIFUSE_CHECK_VALUE(eps >= 0, "epifuse::", op, ": eps must be non-negative, got ", eps);

  FoldProblem f;
  f.N = N;
  f.param_dtype = to_dtype(gamma, op);
  f.bias = bias ? bias->data_ptr() : nullptr;
  f.gamma = gamma.data_ptr();
  f.beta = beta.data_ptr();
  f.pre_scale = pre_scale ? pre_scale->data_ptr() : nullptr;
  f.pre_scale_numel = pre_scale ? pre_scale->numel() : 0;
  f.post_scale = post_scale ? post_scale->data_ptr() : nullptr;
  f.post_scale_numel = post_scale ? post_scale->numel() : 0;
  f.eps = eps;
  return f;
}

std::tuple<at::Tensor, at::Tensor> fold_outputs(const at::Tensor& gamma, FoldProblem& f) {
  auto options = gamma.options().dtype(at::kFloat);
  at::Tensor a = new_cuda({f.N}, options);
  at::Tensor c = new_cuda({f.N}, options);
  f.a = a.data_ptr<float>();
  f.c = c.data_ptr<float>();
  return {a, c};
}

void check_sums(const at::Tensor& t, const char* name, int64_t numel, const at::Tensor& ref,
                const char* op) {
  check_device(t, op, name, ref);
  EPIFUSE_CHECK(t.scalar_type() == at::kDouble && t.is_contiguous() && t.dim() == 1 &&
                    t.size(0) == numel,
                "epifuse::", op, ": expected ", name, " to be a contiguous float64 [", numel,
                "] tensor, got ", t.scalar_type(), " ", t.sizes());
}

namespace {
// [first, last) bytes a strided tensor's elements lie in (empty: {0, 0}).
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  const auto first = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return {first, first + uintptr_t(extent) * t.element_size()};
}
}  // namespace

void check_written_apart(const at::Tensor& written, const std::optional<at::Tensor>& read,
                         const char* op, const char* written_name, const char* read_name) {
  if (!read.has_value() || !read->defined()) return;
  const auto [w0, w1] = byte_span(written);
  const auto [r0, r1] = byte_span(*read);
  EPIFUSE_CHECK(w0 == w1 || r0 == r1 || r1 <= w0 || w1 <= r0, "epifuse::", op,
                ": unsupported operation: ", read_name, " and the written-to ", written_name,
                " share memory (some elements refer to a single memory location). Please clone() ",
                read_name, " before performing the operation.");
}

}  // namespace epifuse
