"""The Python side of the ``torch.ops.epifuse`` ops: their float64 CPU references and fake kernels.

Every op's schema, argument checks and CUDA kernel are C++ (``cpp/ops/<family>.cpp``). The C++
kernel checks its arguments on any device, then runs the CUDA kernels or, for CPU tensors, calls
``torch.ops.epifuse_reference.<op>``: the same schema, whose only kernel is registered here and
computes the op's math with ``fold.py`` in float64 (the executable spec of the CUDA kernels, which
lets ``opcheck`` and the CPU suite run without a GPU). The fake kernels give shapes and dtypes for
FakeTensor / torch.compile. One module per family, as in C++:

  gemm      gemm_affine, gemm_colstats, backward_matmul, gemm_operand
  fold      bn_fold_train, bn_fold_eval, bn_fold_batch, update_running_stats
  apply     affine_softmax, affine_softmax_, affine_, affine
  backward  softmax_grad_rowdot, head_grad_sums, head_grad_coefficients, head_grad_z
  synced    pack_moments, merge_fold, normalized_grad_sums (+ the hooks' fake kernels)
  head      fused_head, fused_head_backward (fake kernels; their CPU kernel is the C++ composite)
  linear    fused_linear (fake kernel; its CPU kernel is the C++ composite)

Imported once the library is loaded (``epifuse/__init__.py``).
"""

from . import apply, backward, fold, gemm, head, linear, synced  # noqa: F401  (registers the kernels)
