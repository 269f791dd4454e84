"""KernelBench level 2, problem 84: Gemm_BatchNorm_Scaling_Softmax.

``Model`` is the reference (plain PyTorch); ``ModelNew`` is the same module
with a fused forward: on Hopper it is one GEMM with a column-statistics
epilogue and one affine+softmax pass in training, one GEMM with an affine
epilogue plus an in-place softmax in eval.
"""

import torch
import torch.nn as nn

from epifuse.distributed import configure_sync_batchnorm
from epifuse.head import HeadSpec, run_head, softmax_module_changed
from epifuse.precision import validate_precision
from epifuse.scripting import NotScriptable


class Model(nn.Module):
    """Gemm, BatchNorm, scaling, softmax."""

    def __init__(self, in_features, out_features, bn_eps=1e-5, bn_momentum=0.1, scale_shape=(1,)):
        super(Model, self).__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features, eps=bn_eps, momentum=bn_momentum)
        self.scale = nn.Parameter(torch.ones(scale_shape))
        self.softmax = nn.Softmax(dim=1)

    def forward(self, x):
        x = self.gemm(x)
        x = self.bn(x)
        x = self.scale * x
        x = self.softmax(x)
        return x


_SPEC = HeadSpec(scale_before_bn=False, softmax=True)


class ModelNew(NotScriptable, Model):
    """Model with the fused epifuse forward; identical parameters and state_dict.

    ``precision`` ("ieee" | "3xtf32" | "tf32" | None) is the fp32 GEMM policy; None follows
    torch.get_float32_matmul_precision() at call time. ``sync_batchnorm=True``
    synchronizes the batch statistics over ``process_group`` (default: the
    whole world) in data-parallel training, as nn.SyncBatchNorm does; see
    epifuse.distributed. ``torch.jit.script`` raises (see epifuse.scripting); use
    torch.compile.
    """

    def __init__(self, in_features, out_features, bn_eps=1e-5, bn_momentum=0.1, scale_shape=(1,),
                 *, precision=None, sync_batchnorm=False, process_group=None):
        super().__init__(in_features, out_features, bn_eps, bn_momentum, scale_shape)
        self.precision = validate_precision(precision)
        configure_sync_batchnorm(self, sync_batchnorm, process_group)

    def forward(self, x):
        if softmax_module_changed(self.softmax, 1):
            # Model's nn.Softmax(dim=1) made into something else since (another dim or module,
            # hooks): the head up to the scale as always (fused, or synchronized), then the module.
            return self.softmax(run_head(self, x, _BODY_SPEC, _body))
        return run_head(self, x, _SPEC, Model.forward)


_BODY_SPEC = HeadSpec(scale_before_bn=False, softmax=False)


def _body(model, x):
    """Model.forward up to the scale."""
    return model.scale * model.bn(model.gemm(x))


batch_size = 1024
in_features = 8192
out_features = 8192
bn_eps = 1e-5
bn_momentum = 0.1
scale_shape = (1,)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, bn_eps, bn_momentum, scale_shape]
