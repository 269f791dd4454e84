// Calling ops through the dispatcher from C++, typed by their C++ functions' own signatures
// (ops.h), so that no call site restates a schema:
//
//   EPIFUSE_OP(gemm_colstats)(x, w, precision)          epifuse::gemm_colstats, any backend
//   EPIFUSE_REFERENCE(gemm_colstats)(x, w, precision)   its float64 reference (the CPU kernels)
//
// Every op is defined twice from one schema string (define_ops below): epifuse::name, whose CPU and
// CUDA kernel is one C++ function that checks its arguments and then runs the CUDA kernels, or for
// CPU tensors calls epifuse_reference::name, whose only kernel is Python's float64 math
// (python/epifuse/_ops/, over fold.py). So the checks exist once, in C++, for every device.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

namespace epifuse {

template <class Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The typed handle of `ns::name`, found on first use (after every library defining it has loaded)
// and kept. epifuse::ops::name is the C++ function (ops.h) whose signature types the handle.
#define EPIFUSE_OP_IN_(ns, name)                                                              \
  ([]() -> const auto& {                                                                    \
    static const auto handle = ::epifuse::find_op<decltype(::epifuse::ops::name)>(ns "::" #name); \
    return handle;                                                                          \
  }())
#define EPIFUSE_OP(name) EPIFUSE_OP_IN_("epifuse", name)
#define EPIFUSE_REFERENCE(name) EPIFUSE_OP_IN_("epifuse_reference", name).call

// An op family's schemas, defined in both namespaces (TORCH_LIBRARY_FRAGMENT(epifuse, m) and
// TORCH_LIBRARY_FRAGMENT(epifuse_reference, m) call it with their library).
inline void define_ops(torch::Library& m, const std::vector<std::string>& schemas) {
  for (const std::string& schema : schemas) m.def(schema.c_str());
}

// A family's registration (at file scope, after its functions): `schemas` (a function returning
// its schema strings) defined in epifuse:: and in epifuse_reference::, and `impls` (a function
// registering its C++ functions on a torch::Library) as the CPU and the CUDA kernels.
#define EPIFUSE_REGISTER_OPS(schemas, impls)                                                   \
  TORCH_LIBRARY_FRAGMENT(epifuse, m) { ::epifuse::define_ops(m, schemas()); }                   \
  TORCH_LIBRARY_FRAGMENT(epifuse_reference, m) { ::epifuse::define_ops(m, schemas()); }         \
  TORCH_LIBRARY_IMPL(epifuse, CPU, m) { impls(m); }                                              \
  TORCH_LIBRARY_IMPL(epifuse, CUDA, m) { impls(m); }

// An autograd kernel's "call the op again, below autograd": the kernel behind the Autograd key
// runs (CUDA, CPU or AutocastCUDA's) and no node is recorded.
template <class Handle, class... Args>
decltype(auto) call_below_autograd(const Handle& op, Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(std::forward<Args>(args)...);
}

}  // namespace epifuse
