// RelayCore's own helpers, shared by its source files (relay_core*.cc). Not for other users.
#pragma once

#include <array>
#include <string>

#include "absl/strings/string_view.h"
#include "agent/fkserve/relay/fuse_wire.h"
#include "agent/fkserve/relay/node_table.h"
#include "agent/fkserve/relay/relay_state.h"

namespace fusekeeper::relay::core_internal {


inline constexpr uint32_t kPage = 4096;
// Bytes of a request that may hold ids the relay rewrites (header + the largest fixed part that
// holds one: fuse_copy_file_range_in's fh_out ends at 40 + 32).
inline constexpr size_t kPatchPrefix = 128;

inline constexpr int kMaxDeathsPerRequest = 3;

inline bool IsDot(absl::string_view name) { return name == "." || name == ".."; }

// Where a request holds file handles: FhOffset's, and COPY_FILE_RANGE's fh_out (-1: none).
inline std::array<long, 2> HandleOffsets(uint32_t opcode, const std::string& msg) {
  return {FhOffset(opcode, msg.data(), msg.size()),
          opcode == FUSE_COPY_FILE_RANGE ? static_cast<long>(kInHeader + offsetof(fuse_copy_file_range_in, fh_out))
                                         : -1};
}

// A node as the journal keeps it.
inline SavedNode SavedNodeOf(const Node& n) { return SavedNode{n.parent, std::string(n.name()), n.kernel_lookups}; }

inline bool UsesHeaderNode(uint32_t opcode) {
  return opcode != FUSE_INIT && opcode != FUSE_INTERRUPT && opcode != FUSE_BATCH_FORGET && opcode != FUSE_DESTROY;
}

}  // namespace fusekeeper::relay::core_internal
