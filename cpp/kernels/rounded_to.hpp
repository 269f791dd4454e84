// RoundedTo<ElementD>::Op, a fragment functor of the GEMM epilogues: each fp32 element rounded to
// ElementD and back (exact in fp32), i.e. z as the GEMM stores it; the identity for an fp32
// ElementD. The column statistics of both epilogue generations (epilogues.hpp, sm80_epilogues.hpp)
// sum it, so that they are the statistics of the stored z (epilogues.hpp says why).
#pragma once

#include <type_traits>

#include "cutlass/cutlass.h"

namespace epifuse {

template <class ElementD>
struct RoundedTo {
  template <class Fragment>
  struct Op {
    CUTLASS_HOST_DEVICE Fragment operator()(Fragment const& x) const {
      if constexpr (std::is_same_v<ElementD, float>) {
        return x;
      } else {
        Fragment y;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < Fragment::kElements; ++i) y[i] = float(ElementD(x[i]));
        return y;
      }
    }
  };
};

}  // namespace epifuse
