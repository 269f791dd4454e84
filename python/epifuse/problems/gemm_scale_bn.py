"""KernelBench level 2, problem 39: Gemm_Scale_BatchNorm.

``Model`` is the reference (plain PyTorch); ``ModelNew`` is the same module
with a fused forward: on Hopper it is one GEMM with a column-statistics
epilogue and one in-place affine pass in training, a single GEMM with an
affine epilogue in eval.
"""

import torch
import torch.nn as nn

from epifuse.distributed import configure_sync_batchnorm
from epifuse.head import HeadSpec, run_head
from epifuse.precision import validate_precision
from epifuse.scripting import NotScriptable


class Model(nn.Module):
    """Gemm, scaling, BatchNorm."""

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super(Model, self).__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x):
        x = self.gemm(x)
        x = x * self.scale
        x = self.bn(x)
        return x


_SPEC = HeadSpec(scale_before_bn=True, softmax=False)


class ModelNew(NotScriptable, Model):
    """Model with the fused epifuse forward; identical parameters and state_dict.

    ``precision`` ("ieee" | "3xtf32" | "tf32" | None) is the fp32 GEMM policy; None follows
    torch.get_float32_matmul_precision() at call time. ``sync_batchnorm=True``
    synchronizes the batch statistics over ``process_group`` (default: the
    whole world) in data-parallel training, as nn.SyncBatchNorm does; see
    epifuse.distributed. ``torch.jit.script`` raises (see epifuse.scripting); use
    torch.compile.
    """

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1,
                 *, precision=None, sync_batchnorm=False, process_group=None):
        super().__init__(in_features, out_features, scale_shape, eps, momentum)
        self.precision = validate_precision(precision)
        configure_sync_batchnorm(self, sync_batchnorm, process_group)

    def forward(self, x):
        return run_head(self, x, _SPEC, Model.forward)


batch_size = 16384
in_features = 4096
out_features = 4096
scale_shape = (out_features,)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scale_shape]
