// Pulse: how an instance with the relay's core in it (in_program.h) is doing, in a page of shared
// memory the launcher's relay reads to tell a hung program (relay.h, ProgramLimits) without seeing
// its traffic. Written by the program's core after each message, read by the relay's watch.
#pragma once

#include <stdint.h>
#include <time.h>

#include <atomic>

namespace fusekeeper::relay {

struct Pulse {
  std::atomic<int64_t> last_activity_ns{0};  // CLOCK_MONOTONIC: a request read, or a message from the program
  std::atomic<int64_t> busy_since_ns{0};     // since when requests (lock waits aside) have been in flight
  std::atomic<uint32_t> busy{0};             // requests (lock waits aside) in flight to the program
  std::atomic<uint32_t> init_done{0};        // the kernel's FUSE_INIT is answered
};
static_assert(sizeof(Pulse) <= 4096);

inline int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace fusekeeper::relay
