// libFuzzer target: the kubelet PodList parser and the restart detector must never crash, and
// every pod the parser accepts has a uid and named containers.
#include <cstddef>
#include <cstdint>
#include <string>

#include "agent/kubelet/pod_list.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fusekeeper::RestartDetector detector;
  auto pods = fusekeeper::ParsePodList(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (pods.ok()) {
    for (const auto& p : *pods) {
      if (p.uid.empty()) __builtin_trap();
      for (const auto& c : p.containers) {
        if (c.name.empty()) __builtin_trap();
      }
    }
    (void)detector.Update(*pods);
  }
  return 0;
}
