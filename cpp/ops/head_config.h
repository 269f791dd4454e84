// epifuse::HeadConfig: a head's settings, the one description of them across the op boundary.
//
// Every head op takes its tensors positionally and its settings keyword-only with defaults,
// e.g. fused_head(Tensor x, ..., Tensor(c!)? num_batches_tracked, *, str precision='3xtf32', ...). The table
// below is the only place a setting is named: it generates
//   * the HeadConfig struct (one member per row),
//   * the keyword section of the fused_head / fused_head_backward schemas (head_schema_kwargs()),
//     and the keyword sections of the per-pass ops that take a few of the settings
//     (head_schema_kwargs({"eps"}), ...),
//   * the typed kernel parameters (EPIFUSE_HEAD_PARAMS) and HeadConfig's parse from them
//     (EPIFUSE_HEAD_CONFIG_FROM_PARAMS), the arguments of an op call (EPIFUSE_HEAD_ARGS),
//   * the autograd save / restore (save_head_config, load_head_config).
// Adding a setting: one row here, its field in python/epifuse/head_config.py (HeadConfig, with
// the same default: tests/test_ops.py checks they agree), and the code that uses it.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/string_view.h>
#include <torch/autograd.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace epifuse {

using OptDType = std::optional<at::ScalarType>;

// X(name, member type, kernel argument type, schema type, schema default)
// clang-format off
#define EPIFUSE_HEAD_CONFIG(X)                                                                     \
  /* The GEMMs' math for float32 inputs: 'ieee' (SGEMM), '3xtf32' (split operands, fp32         \
     accuracy, PyTorch's 'highest') or 'tf32' (one TF32 pass); 16-bit inputs ignore it (pass ''  \
     or any of these). The backward's dX / dW run in the same mode. */                           \
  X(precision,       std::string,           c10::string_view,      "str",    "'3xtf32'")           \
  /* BatchNorm normalizes with the batch's statistics (True) or the running ones (False). */      \
  X(training,        bool,                  bool,                  "bool",   "True")               \
  /* Where the model's scale sits: True, before BatchNorm (problem 39: bn(z * scale));            \
     False, after it (problem 84: scale * bn(z)). */                                               \
  X(scale_before_bn, bool,                  bool,                  "bool",   "False")              \
  /* A row softmax ends the head (problem 84). */                                                  \
  X(softmax,         bool,                  bool,                  "bool",   "False")              \
  /* The activation after the per-column affine (and a scale after BatchNorm), before the        \
     softmax: '' (none), 'relu', 'leaky_relu', 'gelu', 'gelu_tanh' (GELU approximate='tanh') or  \
     'silu' (activation_from_name() in op_args.cpp names them). */                       \
  X(activation,      std::string,           c10::string_view,      "str",    "''")                 \
  /* LeakyReLU's slope for negative inputs (its default); the other activations ignore it. */      \
  X(negative_slope,  double,                double,                "float",  "0.01")               \
  /* BatchNorm's momentum for the running-statistics update (None: cumulative average, as        \
     nn.BatchNorm1d), which fused_head makes in training when given num_batches_tracked. */      \
  X(momentum,        std::optional<double>, std::optional<double>, "float?", "0.1")                \
  /* BatchNorm's eps (added to the variance). */                                                   \
  X(eps,             double,                double,                "float",  "1e-05")              \
  /* Non-empty: training statistics over the ranks of this process group (its group_name;        \
     the synced_* hooks); '': this process's batch only. */                                        \
  X(group_name,      std::string,           c10::string_view,      "str",    "''")              \
  /* The head owns a scale (False: `scale` is a stand-in the ops do not read: the fold            \
     multiplies by nothing and the backward computes no scale gradient, zeros where asked for).  \
     Under autocast a real fp32 scale also promotes the output dtype, as in eager. */            \
  X(has_scale,       bool,                  bool,                  "bool",   "True")               \
  /* The dtype the GEMMs run in: x and W are cast to it inside the op (the statistics, fold and   \
     passes stay fp32; dW comes back in the parameters' dtype). None: x's dtype. The AutocastCUDA \
     kernel sets it to the autocast dtype. */                                                      \
  X(gemm_dtype,      OptDType,              OptDType,              "ScalarType?", "None")          \
  /* The output's dtype; None: z's, i.e. the GEMM's. The AutocastCUDA kernel sets the dtype the    \
     unfused modules return under the same autocast (fp32 after a softmax or an fp32 scale). */   \
  X(out_dtype,       OptDType,              OptDType,              "ScalarType?", "None")         \
  /* The dtype fused_head_backward returns dX in; None: z's (the GEMM's). float32 from a 16-bit    \
     z: the dX GEMM writes it itself (fp16: with fp16's overflow), no 16-bit dX and no cast pass. \
     The autograd kernel sets x's dtype, which dX must have (an fp32 x under autocast). */        \
  X(grad_x_dtype,    OptDType,              OptDType,              "ScalarType?", "None")         \
  /* The output may be differentiated: fused_head returns z and the statistics for a backward.    \
     False (no_grad, inference): nothing is kept (an eval head's layer is one GEMM with the fold  \
     and activation in its epilogue; a training head's pass overwrites z); the rest is empty. */  \
  X(for_backward,    bool,                  bool,                  "bool",   "True")
// clang-format on

struct HeadConfig {
#define EPIFUSE_HEAD_MEMBER(name, type, arg_type, schema_type, schema_default) type name;
  EPIFUSE_HEAD_CONFIG(EPIFUSE_HEAD_MEMBER)
#undef EPIFUSE_HEAD_MEMBER
};

// In a kernel's parameter list, after its last tensor: `..., const Tensor& running_var
// EPIFUSE_HEAD_PARAMS)` declares one parameter per setting, named as the field.
#define EPIFUSE_HEAD_PARAM_(name, type, arg_type, schema_type, schema_default) , arg_type name
#define EPIFUSE_HEAD_PARAMS EPIFUSE_HEAD_CONFIG(EPIFUSE_HEAD_PARAM_)
// The same parameters' types, for an op handle's signature.
#define EPIFUSE_HEAD_PARAM_TYPE_(name, type, arg_type, schema_type, schema_default) , arg_type
#define EPIFUSE_HEAD_PARAM_TYPES EPIFUSE_HEAD_CONFIG(EPIFUSE_HEAD_PARAM_TYPE_)
// The parse, in a kernel declared with EPIFUSE_HEAD_PARAMS: `const HeadConfig cfg
// EPIFUSE_HEAD_CONFIG_FROM_PARAMS;`
#define EPIFUSE_HEAD_FROM_PARAM_(name, type, arg_type, schema_type, schema_default) type(name),
#define EPIFUSE_HEAD_CONFIG_FROM_PARAMS {EPIFUSE_HEAD_CONFIG(EPIFUSE_HEAD_FROM_PARAM_)}
// A call's arguments from a HeadConfig variable named cfg: `op.call(x, ..., running_var
// EPIFUSE_HEAD_ARGS)`.
#define EPIFUSE_HEAD_ARG_(name, type, arg_type, schema_type, schema_default) , cfg.name
#define EPIFUSE_HEAD_ARGS EPIFUSE_HEAD_CONFIG(EPIFUSE_HEAD_ARG_)

// The keyword-only section of a schema: "*, str precision='3xtf32', bool training=True, ..." for
// every setting (names empty) or for the named ones, in the table's order (the order of the
// kernels' trailing parameters).
inline std::string head_schema_kwargs(std::initializer_list<const char*> names = {}) {
  std::string out = "*";
  size_t found = 0;
  auto add = [&](const char* name, const char* schema_type, const char* schema_default) {
    bool wanted = names.size() == 0;
    for (const char* n : names) wanted = wanted || std::string(n) == name;
    if (!wanted) return;
    out = out + ", " + schema_type + " " + name + "=" + schema_default;
    ++found;
  };
#define EPIFUSE_HEAD_SCHEMA_(name, type, arg_type, schema_type, schema_default) \
  add(#name, schema_type, schema_default);
  EPIFUSE_HEAD_CONFIG(EPIFUSE_HEAD_SCHEMA_)
#undef EPIFUSE_HEAD_SCHEMA_
  TORCH_CHECK(names.size() == 0 || found == names.size(),
              "epifuse: head_schema_kwargs was asked for a setting that EPIFUSE_HEAD_CONFIG lacks");
  return out;
}

// The autograd's save and restore of a config: one tuple in ctx->saved_data, the settings in the
// table's order. (An entry per setting cost a forward ~14 hashed string keys and the map's growth.)
inline constexpr const char* kHeadConfigKey = "head_config";

inline void save_head_config(torch::autograd::AutogradContext* ctx, const HeadConfig& cfg) {
  std::vector<c10::IValue> settings;
#define EPIFUSE_HEAD_SAVE_(name, type, arg_type, schema_type, schema_default) \
  settings.emplace_back(cfg.name);
  EPIFUSE_HEAD_CONFIG(EPIFUSE_HEAD_SAVE_)
#undef EPIFUSE_HEAD_SAVE_
  ctx->saved_data[kHeadConfigKey] = c10::ivalue::Tuple::create(std::move(settings));
}

inline HeadConfig load_head_config(torch::autograd::AutogradContext* ctx) {
  const auto& settings = ctx->saved_data.at(kHeadConfigKey).toTupleRef().elements();
  HeadConfig cfg;
  size_t i = 0;
#define EPIFUSE_HEAD_LOAD_(name, type, arg_type, schema_type, schema_default) \
  cfg.name = settings.at(i++).to<type>();
  EPIFUSE_HEAD_CONFIG(EPIFUSE_HEAD_LOAD_)
#undef EPIFUSE_HEAD_LOAD_
  return cfg;
}

}  // namespace epifuse
