// Typed handles of the ops a composite calls through the dispatcher (fused_head.cpp,
// synced_hooks.cpp): looked up on first use and kept, so that a call costs no schema lookup.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <utility>

namespace epifuse {

template <class Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// EPIFUSE_OP(handle, "name", Signature) defines handle(): epifuse::name's typed handle, found on
// the first call (after every library registering the op has loaded) and kept.
#define EPIFUSE_OP(handle, name, ...)                                  \
  const auto& handle() {                                               \
    static const auto h = ::epifuse::find_op<__VA_ARGS__>("epifuse::" name); \
    return h;                                                          \
  }

// An autograd kernel's "call the op again, below autograd": the kernel behind the Autograd key
// runs (CUDA, CPU or AutocastCUDA's) and no node is recorded.
template <class Handle, class... Args>
decltype(auto) call_below_autograd(const Handle& op, Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(std::forward<Args>(args)...);
}

}  // namespace epifuse
