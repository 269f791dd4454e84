// Operand copies in chunks: the chunk sizes and the sub-problems of one chunk (operand_chunks.hpp
// says why the copies are chunked and where the budgets came from).
#include "operand_chunks.hpp"

#include <algorithm>

#include "split_fp16.hpp"

namespace epifuse::dispatch {

int64_t copy_chunk_rows(int64_t n, size_t row_bytes, size_t budget) {
  const int64_t most = std::max<int64_t>(
      int64_t(budget / std::max<size_t>(row_bytes, 1)) / 256 * 256, 256);
  if (n <= most) return n;
  const int64_t chunks = (n + most - 1) / most;
  return ((n + chunks - 1) / chunks + 255) / 256 * 256;
}

void refine_split_chunks(int64_t M, int64_t N, size_t fp32_row_bytes, int64_t& x_chunk,
                         int64_t& w_chunk) {
  auto tiles = [](int64_t r, int64_t c) { return ((r + 127) / 128) * ((c + 127) / 128); };
  auto half = [](int64_t n) { return ((n + 1) / 2 + 255) / 256 * 256; };
  while (tiles(x_chunk, w_chunk) >= 2 * kMinChunkTiles) {
    int64_t& larger = x_chunk > w_chunk ? x_chunk : w_chunk;
    if (larger <= 256 || half(larger) >= larger) break;
    larger = half(larger);
  }
  x_chunk = std::min(x_chunk, M);
  w_chunk = std::min(w_chunk, N);
  if (x_chunk == M) {
    w_chunk = halve_chunk_for_memory(w_chunk, fp32_row_bytes, kWSplitSoftBytes, half,
                                     [&](int64_t w) { return tiles(M, w) >= kMinSoftChunkTiles; });
  }
}

GemmProblem split_problem(const GemmProblem& p, const void* x_split, const void* w_split) {
  GemmProblem s = p;
  s.K = split_fp16_ld(p.K);
  s.x = x_split;
  s.ldx = s.K;
  s.w = w_split;
  s.ldw = s.K;
  s.x_col_stride = s.w_col_stride = 1;
  s.w_split = nullptr;
  // Where each split keeps its rows' exponents (a split of this problem's M rows / N rows).
  s.x_exponents = x_split != nullptr ? split_fp16_exponents(x_split, p.M, p.K) : nullptr;
  s.w_exponents = w_split != nullptr ? split_fp16_exponents(w_split, p.N, p.K) : nullptr;
  return s;
}

size_t row_flag_bytes(const GemmProblem& p) { return (sizeof(int) * size_t(p.M) + 255) / 256 * 256; }

GemmProblem row_chunk(const GemmProblem& p, int64_t r0, int64_t m) {
  GemmProblem c = p;
  c.M = m;
  c.x = static_cast<const float*>(p.x) + r0 * p.ldx;
  c.out = static_cast<float*>(p.out) + r0 * p.ldo;
  return c;
}

GemmProblem column_chunk(const GemmProblem& p, int64_t c0, int64_t n) {
  GemmProblem c = p;
  c.N = n;
  c.w = static_cast<const float*>(p.w) + c0 * p.ldw;
  c.out = static_cast<float*>(p.out) + c0;
  return c;
}

EpilogueOperands column_chunk(const EpilogueOperands& ops, int64_t c0) {
  EpilogueOperands c = ops;
  if (c.a != nullptr) c.a += c0;
  if (c.c != nullptr) c.c += c0;
  if (c.colsum != nullptr) c.colsum += c0;
  if (c.colsumsq != nullptr) c.colsumsq += c0;
  return c;
}

}  // namespace epifuse::dispatch
