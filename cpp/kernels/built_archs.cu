// What this build can run (kernels.h): the GPU architectures its kernels were compiled for
// (CMake's EPIFUSE_ARCHS, passed as EPIFUSE_BUILT_ARCHS), and whether a device is one of them.
#include <cstdlib>
#include <string>

#include "epifuse/kernels.h"

#ifndef EPIFUSE_BUILT_ARCHS
#error "EPIFUSE_BUILT_ARCHS must name the compiled architectures (CMakeLists.txt defines it)"
#endif

namespace epifuse {
namespace {

// One entry of EPIFUSE_BUILT_ARCHS ("80", "86", "90a"): the last digit is the minor version.
bool arch_runs_on(const std::string& arch, int cc_major, int cc_minor) {
  const bool specific = !arch.empty() && arch.back() == 'a';  // sm_90a code runs on 9.0 only
  const std::string digits = specific ? arch.substr(0, arch.size() - 1) : arch;
  if (digits.size() < 2) return false;
  const int major = std::atoi(digits.substr(0, digits.size() - 1).c_str());
  const int minor = digits.back() - '0';
  return major == cc_major && (specific ? minor == cc_minor : minor <= cc_minor);
}

}  // namespace

const char* built_archs() { return EPIFUSE_BUILT_ARCHS; }

bool supports_device(int cc_major, int cc_minor) {
  const std::string archs = EPIFUSE_BUILT_ARCHS;
  size_t start = 0;
  while (start < archs.size()) {
    size_t end = archs.find(',', start);
    if (end == std::string::npos) end = archs.size();
    if (arch_runs_on(archs.substr(start, end - start), cc_major, cc_minor)) return true;
    start = end + 1;
  }
  return false;
}

}  // namespace epifuse
