"""epifuse: CUTLASS epilogue-fusion kernels for GEMM + BatchNorm heads.

Importing the package checks that torch is the one the compiled op library
(``lib/libepifuse_ops.so``) was built against (``lib/build_info.json``), loads
the library and registers the CPU and fake kernels of its ops.
"""

from ._version import __version__
from ._library import build_info, load_library

load_library()

from . import fold, ops, precision  # noqa: E402  (ops need the library loaded)
from . import distributed, head, linear, problems  # noqa: E402
from .distributed import convert_sync_batchnorm  # noqa: E402
from .functional import softmax  # noqa: E402
from .head import fast_path_reason  # noqa: E402
from . import nn  # noqa: E402  (epifuse.nn: FusedLinearBatchNorm)
from .fusion import FuseReport, fuse  # noqa: E402
from .problems.gemm_bn_scale_softmax import ModelNew  # noqa: E402

__all__ = ["FuseReport", "ModelNew", "__version__", "build_info", "convert_sync_batchnorm", "distributed",
           "fast_path_reason", "fold", "fuse", "head", "nn", "ops", "precision", "problems",
           "softmax"]
