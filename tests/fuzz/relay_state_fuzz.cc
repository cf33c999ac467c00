// libFuzzer target: a relay state journal (agent/fkserve/relay/relay_state.h) as a new launcher
// reads it back, from any bytes (a dead launcher's torn or damaged memfd, or a hostile one). The
// parser never crashes; what it accepts restores into a RelayCore whose node table's invariants
// hold, and written out again it reads back the same.
#include <cstddef>
#include <cstdint>
#include <string>

#include "agent/fkserve/relay/relay_core.h"
#include "agent/fkserve/relay/relay_state.h"

namespace {

class Sink : public fusekeeper::relay::RelayOutput {
 public:
  void ToKernel(const char*, size_t) override {}
  void ToProgram(const iovec*, int) override {}
  void Log(const std::string&) override {}
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fusekeeper::relay;
  // The header is given (a journal that is not one is refused at its first 8 bytes): the fuzzer
  // spends its time on the records.
  std::string file("FKRELAY1", 8);
  const uint64_t start = 4096;
  file.append(reinterpret_cast<const char*>(&start), 8);
  file.resize(4096, '\0');
  file.append(reinterpret_cast<const char*>(data), size);
  uint64_t end = 0;
  auto state = StateJournal::Parse(file, &end);
  if (!state.ok()) return 0;
  if (end < start || end > file.size()) __builtin_trap();
  Sink sink;
  RelayCore core(&sink, (1 << 20) + 4096);
  core.Restore(*state);
  if (!core.nodes().CheckInvariantsForTest().empty()) __builtin_trap();
  core.ProgramStarted();
  return 0;
}
