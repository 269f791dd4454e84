"""Reference problems (KernelBench file convention: Model, ModelNew, get_inputs, get_init_inputs)."""

from . import gemm_bn_scale_softmax, gemm_scale_bn

# KernelBench problem number -> module.
BY_NUMBER = {84: gemm_bn_scale_softmax, 39: gemm_scale_bn}

__all__ = ["BY_NUMBER", "gemm_bn_scale_softmax", "gemm_scale_bn"]
