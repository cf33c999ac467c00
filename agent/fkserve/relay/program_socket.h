// The socket pairs the relay speaks to program instances over (SEQPACKET: one FUSE message per
// packet), with buffers sized for FUSE's largest messages.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"

namespace fusekeeper::relay {

// The largest message a program socket pair carries here: the sender's buffer (capped by the
// kernel at net.core.wmem_max), less the kernel's own accounting and a margin, at most what FUSE
// ever sends. FAILED_PRECONDITION where that is too small to relay FUSE.
absl::StatusOr<size_t> LargestProgramMessage();

// A new pair: `ours` non-blocking, the program's end blocking (as /dev/fuse is).
struct ProgramSocketPair {
  UniqueFd ours;
  UniqueFd theirs;
};
absl::StatusOr<ProgramSocketPair> NewProgramSocketPair();

}  // namespace fusekeeper::relay
