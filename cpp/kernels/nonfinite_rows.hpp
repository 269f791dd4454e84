// The 3x GEMM's repair pass for rows of x that hold a NaN or an Inf; see nonfinite_rows.cu.
#pragma once

#include "epifuse/kernels.h"

namespace epifuse {

// For every row m of the fp32 problem p whose x[m, :] is not all finite, recomputes
// p.out[m, :] = act(a[n] * (x[m, :] . w[n, :]) + c[n]) with IEEE fp32 FMAs (a, c null: the plain
// product; act: the epilogue's activation, none where the GEMM's epilogue did not apply one).
// row_flags, if not null, says which rows those are (split_fp16 flagged them), so x is not scanned.
void recompute_nonfinite_rows(const GemmProblem& p, const float* a, const float* c, Activation act,
                              const int* row_flags, cudaStream_t stream);

}  // namespace epifuse
