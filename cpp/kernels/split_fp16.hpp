// The 3x operand split (split_fp16.cu): fp32 [rows, cols] -> row-scaled FP16 hi/lo parts in the
// layout the Hopper 3x mainloop reads (sm90_mainloop_3x.hpp), and each row's scale exponent.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace epifuse {

// Halves per row of a split operand: cols rounded up to 32, times 2 (hi and lo).
int64_t split_fp16_ld(int64_t cols);

// Bytes of a split [rows, cols] operand: its parts, then its rows' exponents (float), then scratch
// for the strided path's row maxima, each part starting on a 256-byte boundary.
size_t split_fp16_bytes(int64_t rows, int64_t cols);

// What one row adds to split_fp16_bytes (its parts, its exponent, its maximum), for sizing chunks.
size_t split_fp16_row_bytes(int64_t cols);

// Where a split's parts and exponents are (split: split_fp16_bytes(rows, cols) bytes).
inline const void* split_fp16_parts(const void* split) { return split; }
const float* split_fp16_exponents(const void* split, int64_t rows, int64_t cols);

// split <- the split of src[r, k] = src[r * ld_row + k * ld_col]: row r scaled by 2^-e[r], e[r] =
// ilogb(max_k |src[r, k]|) - 14, so its largest value lies in [2^14, 2^15) (FP16's largest finite
// is 65504); hi = fp16(v * 2^-e), lo = fp16(v * 2^-e - hi), in blocks of 64 halves per row (the
// 32 hi parts of k = 32j..32j+31, then their 32 lo parts); K is zero-padded to a multiple of 32.
// The exponents are stored as floats (small integers, exact) for the GEMM's epilogue, which
// multiplies the product back by 2^(e_x[m] + e_w[n]). If nonfinite_rows is not null,
// nonfinite_rows[r] becomes 1 for every row holding a NaN or Inf, else 0.
void split_fp16(const float* src, int64_t rows, int64_t cols, int64_t ld_row, int64_t ld_col,
                void* split, int* nonfinite_rows, cudaStream_t stream);

}  // namespace epifuse
