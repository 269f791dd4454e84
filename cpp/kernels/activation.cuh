// The activation of a head, element by element in fp32: act(h) and its derivative act'(h), as
// PyTorch computes them (ReLU, LeakyReLU(negative_slope), GELU with erf or tanh, SiLU).
// python/epifuse/fold.py (activate, activation_grad) is the reference the kernels are tested to.
//
// The kind is a kernel argument, not a template parameter: every row pass takes every activation
// without multiplying its instantiations, and the switch costs a uniform branch per element in
// passes bound by memory bandwidth.
#pragma once

#include <type_traits>

#include "epifuse/kernels.h"

namespace epifuse {

__device__ __forceinline__ float activate(const Activation& act, float h) {
  switch (act.kind) {
    case ActivationKind::kNone: return h;
    case ActivationKind::kReLU: return h > 0.f ? h : 0.f;
    case ActivationKind::kLeakyReLU: return h > 0.f ? h : h * act.negative_slope;
    case ActivationKind::kGELU: return 0.5f * h * (1.f + erff(h * 0.70710678118654752f));
    case ActivationKind::kGELUTanh: {
      const float inner = 0.7978845608028654f * (h + 0.044715f * h * h * h);
      return 0.5f * h * (1.f + tanhf(inner));
    }
    case ActivationKind::kSiLU: return h / (1.f + expf(-h));
  }
  return h;
}

// act over a fragment of N values in place, the switch taken once for the whole fragment: one
// branch-free loop per activation (a switch per element, inside a GEMM epilogue's unrolled
// fragment loop, tripled the epilogue's code and slowed the eval GEMMs by up to 2x, H100).
template <class Fragment, int N>
__device__ __forceinline__ void activate_fragment(const Activation& act, Fragment& h) {
  switch (act.kind) {
    case ActivationKind::kNone: return;
#define EPIFUSE_ACTIVATE_ALL_(kind_)                                            \
  case kind_: {                                                                 \
    constexpr Activation kAct{kind_};                                           \
    _Pragma("unroll") for (int i = 0; i < N; ++i) h[i] = activate(kAct, h[i]); \
    return;                                                                     \
  }
    EPIFUSE_ACTIVATE_ALL_(ActivationKind::kReLU)
    EPIFUSE_ACTIVATE_ALL_(ActivationKind::kGELU)
    EPIFUSE_ACTIVATE_ALL_(ActivationKind::kGELUTanh)
    EPIFUSE_ACTIVATE_ALL_(ActivationKind::kSiLU)
#undef EPIFUSE_ACTIVATE_ALL_
    case ActivationKind::kLeakyReLU: {
      const float slope = act.negative_slope;
#pragma unroll
      for (int i = 0; i < N; ++i) h[i] = h[i] > 0.f ? h[i] : h[i] * slope;
      return;
    }
  }
}

// The activation's kind as a compile-time constant: dispatch_activation calls f(ActivationKindC<k>{})
// through one switch, so that a row pass's loop is compiled once per kind and branches once per
// thread, not per element. A switch per element inside the passes' unrolled loops (32 elements
// an iteration for 16-bit rows: 4 rows of 8) made head_grad_sums' loop ~6300 PTX instructions with
// ~600 branches: 4096 x 4096 ReLU heads took ~40 us whether bf16 or fp32 (twice the bytes), a
// bound set by the instructions, not the bandwidth (H200).
template <ActivationKind kKind>
using ActivationKindC = std::integral_constant<ActivationKind, kKind>;

template <class F>
__device__ __forceinline__ void dispatch_activation(ActivationKind kind, F&& f) {
  switch (kind) {
    case ActivationKind::kNone: f(ActivationKindC<ActivationKind::kNone>{}); return;
    case ActivationKind::kReLU: f(ActivationKindC<ActivationKind::kReLU>{}); return;
    case ActivationKind::kLeakyReLU: f(ActivationKindC<ActivationKind::kLeakyReLU>{}); return;
    case ActivationKind::kGELU: f(ActivationKindC<ActivationKind::kGELU>{}); return;
    case ActivationKind::kGELUTanh: f(ActivationKindC<ActivationKind::kGELUTanh>{}); return;
    case ActivationKind::kSiLU: f(ActivationKindC<ActivationKind::kSiLU>{}); return;
  }
}

// d act / d h at h (ReLU's and LeakyReLU's at 0: 0 and negative_slope, as PyTorch's).
__device__ __forceinline__ float activation_grad(const Activation& act, float h) {
  switch (act.kind) {
    case ActivationKind::kNone: return 1.f;
    case ActivationKind::kReLU: return h > 0.f ? 1.f : 0.f;
    case ActivationKind::kLeakyReLU: return h > 0.f ? 1.f : act.negative_slope;
    case ActivationKind::kGELU: {
      const float cdf = 0.5f * (1.f + erff(h * 0.70710678118654752f));
      const float pdf = 0.3989422804014327f * expf(-0.5f * h * h);
      return cdf + h * pdf;
    }
    case ActivationKind::kGELUTanh: {
      const float k = 0.7978845608028654f, k3 = 0.044715f;
      const float t = tanhf(k * (h + k3 * h * h * h));
      return 0.5f * (1.f + t) + 0.5f * h * (1.f - t * t) * k * (1.f + 3.f * k3 * h * h);
    }
    case ActivationKind::kSiLU: {
      const float s = 1.f / (1.f + expf(-h));
      return s * (1.f + h * (1.f - s));
    }
  }
  return 1.f;
}

}  // namespace epifuse
