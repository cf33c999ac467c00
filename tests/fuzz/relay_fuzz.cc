// libFuzzer target: the relay core (agent/fkserve/relay) fed any sequence of kernel requests,
// program messages (well-formed or not, truncated or not), program deaths and restarts. It never
// crashes, answers every kernel request at most once, and its node table's invariants hold.
//
// Input: records of [kind:1][len:2 little-endian][bytes:len]; kind % 5: 0 a kernel request,
// 1 a program message, 2 a truncated program message, 3 the program dies, 4 a new instance.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>

#include "agent/fkserve/relay/fuse_wire.h"
#include "agent/fkserve/relay/relay_core.h"

namespace {

class Sink : public fusekeeper::relay::RelayOutput {
 public:
  void ToKernel(const char* data, size_t len) override {
    if (len < sizeof(fuse_out_header)) __builtin_trap();
    fuse_out_header h;
    memcpy(&h, data, sizeof(h));
    if (h.len != len) __builtin_trap();  // the relay passes on only consistent messages
    if (h.unique == 0 || (h.unique & 1)) return;  // notifications, interrupt answers
    if (!answered.insert(h.unique).second) __builtin_trap();  // one answer per request
  }
  void ToProgram(const iovec*, int) override {}
  void Log(const std::string&) override {}
  std::set<uint64_t> answered;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Sink sink;
  fusekeeper::relay::RelayCore core(&sink, 1 << 17);
  std::set<uint64_t> sent;
  size_t pos = 0;
  while (pos + 3 <= size) {
    const uint8_t kind = data[pos] % 5;
    size_t len = data[pos + 1] | (static_cast<size_t>(data[pos + 2]) << 8);
    pos += 3;
    len = std::min(len, size - pos);
    std::string msg(reinterpret_cast<const char*>(data + pos), len);
    pos += len;
    switch (kind) {
      case 0:
        if (msg.size() >= sizeof(fuse_in_header)) {
          fuse_in_header h;
          memcpy(&h, msg.data(), sizeof(h));
          // The kernel never reuses a unique it is waiting on, and numbers its own evenly.
          h.unique &= ~(1ULL | fusekeeper::relay::kOwnUniqueBit);
          h.len = static_cast<uint32_t>(msg.size());
          if (sink.answered.count(h.unique) || !sent.insert(h.unique).second) continue;
          memcpy(msg.data(), &h, sizeof(h));
        }
        core.FromKernel(msg.data(), msg.size());
        break;
      case 1:
      case 2:
        core.FromProgram(msg.data(), msg.size(), kind == 2);
        break;
      case 3:
        core.ProgramGone();
        break;
      case 4:
        core.ProgramStarted();
        break;
    }
    if (!core.nodes().CheckInvariantsForTest().empty()) __builtin_trap();
  }
  return 0;
}
