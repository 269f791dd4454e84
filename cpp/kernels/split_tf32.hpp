// The 3xTF32 operand split (split_tf32.cu): fp32 [rows, cols] -> hi/lo TF32 parts in the layout the
// Hopper 3xTF32 mainloop reads (sm90_mainloop_3xtf32.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace epifuse {

// Floats per row of a split operand: cols rounded up to 16, times 2 (hi and lo).
int64_t split_tf32_ld(int64_t cols);

// Bytes of a split [rows, cols] operand, rounded up to 256 (workspace carving).
size_t split_tf32_bytes(int64_t rows, int64_t cols);

// dst[rows, split_tf32_ld(cols)] <- split of src[r, k] = src[r * ld_row + k * ld_col]. If
// nonfinite_rows is not null, nonfinite_rows[r] becomes 1 for every row holding a NaN or Inf, else 0.
void split_tf32(const float* src, int64_t rows, int64_t cols, int64_t ld_row, int64_t ld_col,
                float* dst, int* nonfinite_rows, cudaStream_t stream);

}  // namespace epifuse
