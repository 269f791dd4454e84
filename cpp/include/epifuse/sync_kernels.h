// epifuse kernel API, synchronized batch statistics (data-parallel BatchNorm): the per-rank row a
// forward all-gathers, the merge of all ranks' rows with the fold, and the row a backward
// all-reduces. The op layer runs the collectives between these launchers
// (cpp/ops/synced.cpp).
//
// Torch-free like kernels.h (raw pointers, sizes, a cudaStream_t), and apart from it so that adding
// these kernels leaves the CUTLASS translation units, which include kernels.h, alone.
// python/epifuse/distributed.py and fold.py are the reference for this math; tests hold the kernels
// to them. All arithmetic is fp64; everything stays on the device (no host synchronization).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "epifuse/kernels.h"

namespace epifuse {

// This rank's row, fp64 [2N + 1] = [count, mean (N), M2 (N)] of BatchNorm's input
// u = pre_scale * (z + bias) over `count` >= 1 rows, from the column sums of z (fold.input_moments,
// then distributed.pack_moments: M2 = count * the biased variance). Reads f.N, f.param_dtype,
// f.bias and f.pre_scale (with its numel) only.
void pack_moments(const FoldProblem& f, const double* colsum, const double* colsumsq, int64_t count,
                  double* row, cudaStream_t stream);

// rows: fp64 [world, 2N + 1], one pack_moments row per rank (world >= 1). Merges them as
// distributed.merge_moments does (Chan et al.'s parallel variance: the count-weighted mean, then
// every rank's M2 plus its count times its mean's squared deviation from the merged one; ranks with
// count 0 contribute nothing) and folds with the merged mean and biased variance as
// fold.fold_batch: f.a, f.c. moments = fp64 [2N + 1] = [mean (N), var (N), total count]
// (fold.moments_vector).
void merge_fold(const FoldProblem& f, const double* rows, int64_t world, double* moments,
                cudaStream_t stream);

// out = fp64 [2N + 1] = [G1 (N), G2 (N), M] (fold.normalized_grad_sums): this batch's sums of dy
// and dy * yhat at BatchNorm's output, from head_grad_sums' [S1, S3, M] and the moments the forward
// normalized with. Reads f's N, param_dtype, bias, scales and eps (not gamma, beta, a, c).
void normalized_grad_sums(const FoldProblem& f, const double* sums, const double* moments,
                          double* out, cudaStream_t stream);

}  // namespace epifuse
