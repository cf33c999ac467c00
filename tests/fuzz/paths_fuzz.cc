// libFuzzer target: path and host-path validation (pure) never crash, and anything they accept
// is normalised: no "..", no "." and no empty components.
#include <cstddef>
#include <cstdint>
#include <string>

#include "agent/paths/host_path.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  if (fusekeeper::ValidateHostPath(input).ok()) {
    if (input.find("/../") != std::string::npos || input.find("//") != std::string::npos ||
        (input.size() > 3 && input.compare(input.size() - 3, 3, "/..") == 0) ||
        input.find('\0') != std::string::npos) {
      __builtin_trap();
    }
  }
  (void)fusekeeper::ParseHostPathType(input);
  (void)fusekeeper::IsAtOrBelow(input, "/data");
  return 0;
}
