// Reads the debug switches (debug_switches.hpp) from the environment: the only std::getenv in cpp/.
#include "debug_switches.hpp"

#include <cstdlib>
#include <cstring>

namespace epifuse {
namespace {

// Whether variable `name` is set to exactly `value`.
bool equals(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

}  // namespace

DebugSwitches DebugSwitches::from_environment() {
  DebugSwitches s;
  s.force_sm80 = equals("EPIFUSE_FORCE_SM80", "1");
  const char* promotion = std::getenv("EPIFUSE_3X_PROMOTION");
  const long n = promotion != nullptr ? std::strtol(promotion, nullptr, 10) : 0;
  s.split3x_promotion_interval = n >= 1 && n <= 1024 ? uint32_t(n) : 0;
  s.narrow_small_m = !equals("EPIFUSE_NARROW_SMALL_M", "0");
  s.tf32_k_major_copies = !equals("EPIFUSE_TF32_K_MAJOR_COPIES", "0");
  s.fp16_product = !equals("EPIFUSE_FP16_PRODUCT", "0");
  s.split_wide_tiles = !equals("EPIFUSE_SPLIT_WIDE_TILES", "0");
  s.step_operands = !equals("EPIFUSE_STEP_OPERANDS", "0");
  return s;
}

const DebugSwitches& debug_switches() {
  static const DebugSwitches switches = DebugSwitches::from_environment();
  return switches;
}

bool step_operands_shared() { return debug_switches().step_operands; }

}  // namespace epifuse
