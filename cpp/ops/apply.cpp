// The row passes: a head's fold applied to z (out = act(a[n] * z + c[n])), with or without the row
// softmax, into a new tensor or in place.
//
//   affine_softmax   softmax(act(a * z + c), dim=1) into a new tensor (z's dtype or float32)
//   affine_softmax_  the same in place
//   affine_          act(a * z + c) in place (a, c absent: the activation alone)
//   affine           act(a * z + c) into a new tensor (z's dtype or float32)
//
// Bandwidth-bound: one read and one write of z. a and c are float32 [N]; absent (both None) in the
// optional forms means the identity.
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>

#include "dispatch.h"
#include "op_args.h"
#include "ops.h"

namespace epifuse::ops {
namespace {

struct AffinePair {
  Tensor a, c;  // both undefined = identity
};

AffinePair optional_affine(const Tensor& z, const OptTensor& a, const OptTensor& c,
                           const char* op) {
  EPIFUSE_CHECK(a.has_value() == c.has_value(), "epifuse::", op,
                ": pass both a and c, or neither (no affine)");
  if (!a) return {};
  return {column_vector(*a, z.size(1), op, "a", z), column_vector(*c, z.size(1), op, "c", z)};
}

// The output dtype of an out-of-place pass over z: out_dtype (z's dtype, or float32 from a 16-bit
// z: a head's fp32 output under autocast), z's when None.
at::ScalarType pass_out_dtype(const Tensor& z, OptDType out_dtype, const char* op) {
  const at::ScalarType out = out_dtype.value_or(z.scalar_type());
  EPIFUSE_CHECK(out == z.scalar_type() || (out == at::kFloat && z.element_size() == 2),
                "epifuse::", op, ": out_dtype must be z's dtype (", z.scalar_type(),
                ") or float32 for a 16-bit z, got ", out);
  return out;
}

// An in-place pass's a and c share no memory with z (the kernel would race).
void check_read_apart_from_z(const Tensor& z, const OptTensor& a, const OptTensor& c,
                             const char* op) {
  check_written_apart(z, a, op, "z", "a");
  check_written_apart(z, c, op, "z", "c");
}

const float* floats_or_null(const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

void softmax_into(const Tensor& src, const Tensor& dst, const AffinePair& ac, Activation act) {
  ::epifuse::affine_softmax(to_dtype(src, "affine_softmax"), src.size(0), src.size(1),
                            src.data_ptr(), src.stride(0), to_dtype(dst, "affine_softmax"),
                            dst.data_ptr(), dst.stride(0), floats_or_null(ac.a),
                            floats_or_null(ac.c), act, current_stream());
}

void affine_into(const Tensor& src, const Tensor& dst, const AffinePair& ac, Activation act) {
  column_affine_into(to_dtype(src, "affine"), src.size(0), src.size(1), src.data_ptr(),
                     src.stride(0), to_dtype(dst, "affine"), dst.data_ptr(),
                     std::max<int64_t>(dst.stride(0), 1), floats_or_null(ac.a),
                     floats_or_null(ac.c), act, current_stream());
}

// A pass in place over z: directly where its rows have unit stride, else densely and written back
// through the view.
template <class Pass>
void in_place(const Tensor& z, const Pass& pass) {
  if (z.numel() == 0) return;
  if (z.stride(1) == 1 && z.stride(0) >= z.size(1)) {
    pass(z);
    return;
  }
  const Tensor dense = z.contiguous();
  pass(dense);
  z.copy_(dense);
}

Tensor new_output(const Tensor& z, at::ScalarType dtype) {
  return new_cuda(z.sizes(), z.options().dtype(dtype).memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

Tensor affine_softmax(const Tensor& z, const OptTensor& a, const OptTensor& c,
                      c10::string_view activation, double negative_slope, OptDType out_dtype) {
  const char* op = "affine_softmax";
  check_matrix(z, op);
  const Activation act = activation_from_name(activation, negative_slope, op);
  const AffinePair ac = optional_affine(z, a, c, op);
  const at::ScalarType dtype = pass_out_dtype(z, out_dtype, op);
  if (!z.is_cuda()) {
    return EPIFUSE_REFERENCE(affine_softmax)(z, a, c, activation, negative_slope, out_dtype);
  }
  const auto guard = guard_for(z, op, "z");
  const Tensor out = new_output(z, dtype);
  softmax_into(rows_with_unit_stride(z), out, ac, act);
  return out;
}

void affine_softmax_(const Tensor& z, const OptTensor& a, const OptTensor& c,
                     c10::string_view activation, double negative_slope) {
  const char* op = "affine_softmax_";
  check_matrix(z, op);
  const Activation act = activation_from_name(activation, negative_slope, op);
  const AffinePair ac = optional_affine(z, a, c, op);
  check_read_apart_from_z(z, a, c, op);
  if (!z.is_cuda()) {
    return EPIFUSE_REFERENCE(affine_softmax_)(z, a, c, activation, negative_slope);
  }
  const auto guard = guard_for(z, op, "z");
  in_place(z, [&](const Tensor& t) { softmax_into(t, t, ac, act); });
}

void affine_(const Tensor& z, const OptTensor& a, const OptTensor& c, c10::string_view activation,
             double negative_slope) {
  const char* op = "affine_";
  check_matrix(z, op);
  const Activation act = activation_from_name(activation, negative_slope, op);
  const AffinePair ac = optional_affine(z, a, c, op);
  check_read_apart_from_z(z, a, c, op);
  if (!z.is_cuda()) return EPIFUSE_REFERENCE(affine_)(z, a, c, activation, negative_slope);
  const auto guard = guard_for(z, op, "z");
  in_place(z, [&](const Tensor& t) { affine_into(t, t, ac, act); });
}

Tensor affine(const Tensor& z, const Tensor& a, const Tensor& c, c10::string_view activation,
              double negative_slope, OptDType out_dtype) {
  const char* op = "affine";
  check_matrix(z, op);
  const Activation act = activation_from_name(activation, negative_slope, op);
  const AffinePair ac{column_vector(a, z.size(1), op, "a", z),
                      column_vector(c, z.size(1), op, "c", z)};
  const at::ScalarType dtype = pass_out_dtype(z, out_dtype, op);
  if (!z.is_cuda()) {
    return EPIFUSE_REFERENCE(affine)(z, a, c, activation, negative_slope, out_dtype);
  }
  const auto guard = guard_for(z, op, "z");
  const Tensor out = new_output(z, dtype);
  affine_into(rows_with_unit_stride(z), out, ac, act);
  return out;
}

namespace {

std::vector<std::string> schemas() {
  // out_dtype: the output's dtype, z's (None) or float32 from a 16-bit z (autocast).
  const std::string activation = head_schema_kwargs({"activation", "negative_slope"});
  const std::string activation_out =
      head_schema_kwargs({"activation", "negative_slope", "out_dtype"});
  return {
      "affine_softmax(Tensor z, Tensor? a, Tensor? c, " + activation_out + ") -> Tensor",
      "affine_softmax_(Tensor(a!) z, Tensor? a, Tensor? c, " + activation + ") -> ()",
      "affine_(Tensor(a!) z, Tensor? a, Tensor? c, " + activation + ") -> ()",
      "affine(Tensor z, Tensor a, Tensor c, " + activation_out + ") -> Tensor",
  };
}

void impls(torch::Library& m) {
  m.impl("affine_softmax", &affine_softmax);
  m.impl("affine_softmax_", &affine_softmax_);
  m.impl("affine_", &affine_);
  m.impl("affine", &affine);
}

}  // namespace
}  // namespace epifuse::ops

EPIFUSE_REGISTER_OPS(epifuse::ops::schemas, epifuse::ops::impls)
