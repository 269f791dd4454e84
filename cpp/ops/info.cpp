// Build information as ops (no tensors, so one kernel serves every backend): what the Python
// package asks the library it loaded.
//
//   built_archs()               the GPU architectures compiled in, e.g. "80,90a"
//   supports_device(major, minor)  whether those kernels run on compute capability major.minor
//   precision_names()           the fp32 GEMM precisions the ops take (python/epifuse/precision.py)
#include <torch/library.h>

#include <string>

#include "epifuse/kernels.h"
#include "op_args.h"

TORCH_LIBRARY_FRAGMENT(epifuse, m) {
  m.def("built_archs() -> str", []() { return std::string(epifuse::built_archs()); });
  m.def("supports_device(int major, int minor) -> bool",
        [](int64_t major, int64_t minor) { return epifuse::supports_device(int(major), int(minor)); });
  m.def("precision_names() -> str[]", []() { return epifuse::precision_names(); });
}
