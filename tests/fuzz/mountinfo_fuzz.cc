// libFuzzer target: the mountinfo parser must never crash, and whatever it accepts must be
// searchable.
#include <cstddef>
#include <cstdint>
#include <string>

#include "agent/mount/mountinfo.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto table = fusekeeper::MountTable::Parse(std::string(reinterpret_cast<const char*>(data), size));
  if (table.ok()) {
    for (const auto& e : table->entries()) {
      const auto* top = table->FindTop(e.mount_point);
      if (top == nullptr) __builtin_trap();  // an entry's own mount point must be found
      (void)table->FindById(e.id);
      (void)fusekeeper::EscapeMountField(e.mount_point);
    }
  }
  (void)fusekeeper::UnescapeMountField(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
