// A GEMM from the ops' side: the problem bound from tensors, its plan (the dispatcher in
// cpp/kernels decides kernel and precision), the operand copies and workspace the plan asks for,
// the kept weight split, and cuBLAS where the plan says so. The GEMM ops (gemm.cpp) run every
// product through here.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "epifuse/kernels.h"

namespace epifuse {

// Whether a product's 3x split of w may be kept while w's version is unchanged
// (weight_split_cache.h). Every caller says which, no default: kMayKeep only for a layer's weight as
// the op's caller passed it. The backward's products pass kNeverKeep: their w is W^T or x^T, a view
// made here below autograd's ADInplaceOrView (so with a version counter of its own, which no write
// to the weight bumps: a kept split of it went stale after the first optimizer step), of an
// activation or of a weight that changes every step (a kept split would only pin its bytes again).
enum class WeightSplit { kMayKeep, kNeverKeep };

struct PreparedGemm {
  GemmProblem problem;
  Epilogue epilogue = Epilogue::kAffine;
  int device = 0, cc_major = 0, cc_minor = 0;
  at::Tensor x, w, out;  // keep the (possibly copied) operands alive
  WeightSplit w_split = WeightSplit::kNeverKeep;
};

// x [M, K] . w [N, K]^T -> out [M, N] (dtype of x) in `precision`, on CUDA operands that
// check_gemm_operands (op_args.h) accepted, bound as the caller passed them (views included); the
// plan says which to copy (run_gemm).
PreparedGemm prepare_gemm(const at::Tensor& x, const at::Tensor& w, const std::string& precision,
                          Epilogue epilogue, WeightSplit w_split, const char* op);

GemmPlan plan_gemm(const PreparedGemm& g, const EpilogueOperands& ops);

// Runs the plan: the operand copies it asks for, the kept weight split, the workspace, the GEMM
// with its epilogue (or cuBLAS's SGEMM, then the epilogue as one more pass).
void run_gemm(PreparedGemm& g, const GemmPlan& plan, const EpilogueOperands& ops);
void run_gemm(PreparedGemm& g, const EpilogueOperands& ops);

// out = x . w^T on cuBLAS (at::mm) in the problem's math: IEEE fp32 (FFMA SGEMM), TF32, or the
// 16-bit tensor-core GEMM, independent of the global TF32 flag.
void cublas_product(const PreparedGemm& g);

// A row-major copy of a 2-D operand [R, C] (K-major for a GEMM operand of rows x K): our tiled
// transpose for column-major views (the transposed views of the backward), Tensor::contiguous
// for anything else.
at::Tensor k_major_copy(const at::Tensor& v);

}  // namespace epifuse
