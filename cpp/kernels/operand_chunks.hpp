// Operand copies in chunks (operand_chunks.cu): how a product whose operands are copied first (the
// Hopper 3x GEMM's FP16 split, the K-major copies for cuBLAS TF32) is cut into chunks of rows, and
// the sub-problems of one chunk (the split problem the 3x GEMM runs, a band of output rows or
// columns). The plan sizes the chunks (gemm_plan.cu, cublas_k_major_copies.cu); the launch walks
// them (gemm_run.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "epifuse/kernels.h"

namespace epifuse::dispatch {

// Copies of an operand that a product reads instead of the operand itself (the 3x split, a
// K-major copy for cuBLAS) are made a chunk of rows at a time, one GEMM per chunk, so that the copy
// of a large operand never exists whole (the split of problem 84's 8192x8192 weight is 256 MiB,
// that of problem 39's dZ^T for dW 256 MiB, its K-major copy of X^T in TF32 256 MiB).
// w's rows are the output's columns: at most 128 MiB of the fp32 operand copied at a time. x's rows
// (the output's rows, chunked only for the affine epilogue, whose rows are independent) get twice
// that, since every chunk of x re-reads every chunk of w: fewer re-splits of w. These keep the
// KernelBench problems' training-step peaks within 1.05x eager's (smaller models' steps, whose
// operands fit one chunk, peak higher: BENCHMARKS.md) while a chunk stays about one wave of tiles.
// The budgets count fp32 rows, not the split's bytes: a 3x split row is the fp32 row's bytes plus a
// little padding and an exponent, and counting that made problem 84's 8192-row weight three chunks
// of 2816 rows (88 tiles of 128x256 at M = 1024, two thirds of 132 SMs) instead of two of 4096
// (128 tiles); measured: experiments/README.md, "Kernel selection".
constexpr size_t kWCopyChunkBytes = size_t(128) << 20;
constexpr size_t kXCopyChunkBytes = size_t(256) << 20;

// Rows per chunk of an n-row operand copy of row_bytes a row within `budget` bytes: as few chunks
// as fit, of (nearly) equal sizes, a multiple of 256 rows (two 128-row tiles; column offsets stay
// 16-byte aligned); n when one chunk holds all.
int64_t copy_chunk_rows(int64_t n, size_t row_bytes, size_t budget);

// Large products (the affine epilogue, whose chunks of x's rows are independent): chunks finer than
// the byte budgets while each GEMM keeps at least kMinChunkTiles 128x128 tiles (~8 waves on 132
// SMs, so the last wave's idle SMs cost little), halving the larger of the two chunks each time
// (balanced chunks hold the fewest split bytes for their tiles). Problem 84's dW (8192 x 8192 from
// K = 1024): x's and w's splits of 64 MiB each become two chunks of 32 MiB each, four GEMMs of 1024
// tiles, and the step's peak drops from 1.23x eager's to 1.08x.
constexpr int64_t kMinChunkTiles = 1024;
// The memory rule shared by the 3x splits (below) and the TF32 K-major copies
// (cublas_k_major_copies.cu): a chunk of `rows` rows of row_bytes each becomes half(rows) while
// it holds over `budget` bytes, half(rows) is smaller and enough_tiles(half(rows)) says the
// smaller chunk's GEMM still has enough tiles; returns the chunk's rows.
template <class Half, class EnoughTiles>
int64_t halve_chunk_for_memory(int64_t rows, size_t row_bytes, size_t budget, Half half,
                               EnoughTiles enough_tiles) {
  while (size_t(rows) * row_bytes > budget) {
    const int64_t halved = half(rows);
    if (halved >= rows || !enough_tiles(halved)) break;
    rows = halved;
  }
  return rows;
}

// Then, for memory: where x is one chunk (so a chunk of w is split once, never again per chunk of
// x), w's chunk is halved while its split holds over kWSplitSoftBytes and each GEMM keeps at
// least kMinSoftChunkTiles 128x128 tiles (~4 waves on 132 SMs: the last wave's idle SMs cost a few
// percent, as at 8). The projection MLP's 4096 x 4096 dX and dW (K = 4096): w's 64 MiB split
// becomes two of 32 MiB, two GEMMs of 512 tiles; the KernelBench problems' products keep their
// chunks (problem 84's have too few tiles, problem 39's x is chunked).
constexpr size_t kWSplitSoftBytes = size_t(32) << 20;
constexpr int64_t kMinSoftChunkTiles = 512;
void refine_split_chunks(int64_t M, int64_t N, size_t fp32_row_bytes, int64_t& x_chunk,
                         int64_t& w_chunk);

// The 3x plan's workspace: [x split][flags of x's non-finite rows][w split, unless p.w_split]
// [the GEMM's own workspace].
// The GEMM itself sees the split operands: K' = split_fp16_ld(K) FP16 hi/lo parts per row, and
// the exponents of their rows.
GemmProblem split_problem(const GemmProblem& p, const void* x_split, const void* w_split);

// Bytes of the flags of x's non-finite rows (one int per row, rounded up to 256 bytes).
size_t row_flag_bytes(const GemmProblem& p);

// Output rows [r0, r0 + m) of p: x's rows r0.., out's rows r0..
GemmProblem row_chunk(const GemmProblem& p, int64_t r0, int64_t m);

// Output columns [c0, c0 + n) of p: w's rows c0.., out's columns c0.. (row strides unchanged).
GemmProblem column_chunk(const GemmProblem& p, int64_t c0, int64_t n);

// The epilogue's per-column vectors from column c0 on.
EpilogueOperands column_chunk(const EpilogueOperands& ops, int64_t c0);

}  // namespace epifuse::dispatch
