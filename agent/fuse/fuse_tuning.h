// Per-volume FUSE tuning, from volume_context (as the GCS FUSE CSI driver offers it):
//   readAheadKb          the mount's read-ahead (/sys/class/bdi/0:<minor>/read_ahead_kb), 0..1048576
//   maxBackground        requests the kernel keeps in flight in the background (readahead, async
//                        writes) before it queues more (fusectl max_background), 1..65535
//   congestionThreshold  in-flight background requests above which the mount counts as congested
//                        (fusectl congestion_threshold), 1..65535
// They are the connection's, and the server's answer to FUSE_INIT sets all three (the kernel takes
// its max_background and congestion_threshold, and caps read-ahead at its max_readahead), so the
// agent writes them once the server has answered (FuseKind: its answer probe), and again on every
// fresh connection a repair mounts. A server that restarts and adopts the connection keeps them.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/map.h"
#include "proto/state.pb.h"

namespace fusekeeper {

// The volume_context keys above, validated into `fuse` (INVALID_ARGUMENT naming the key and its
// bounds). Absent keys leave the kernel's values.
absl::Status ParseFuseTuning(const google::protobuf::Map<std::string, std::string>& volume_context,
                             state::Fuse* fuse);
bool IsFuseTuningKey(const std::string& key);
bool HasFuseTuning(const state::Fuse& fuse);

// Writes the tuning `fuse` asks for to connection `dev_minor` (BlockingPool: sysfs and fusectl
// writes). NOT_FOUND if the connection is gone.
absl::Status ApplyFuseTuningBlocking(uint32_t dev_minor, const state::Fuse& fuse);

// What the connection has now, for reports and tests; -1 where it cannot be read.
struct FuseTuningNow {
  int64_t read_ahead_kb = -1;
  int64_t max_background = -1;
  int64_t congestion_threshold = -1;
};
FuseTuningNow ReadFuseTuningBlocking(uint32_t dev_minor);

// "readAheadKb=1024 maxBackground=64" (what is set), for messages.
std::string DescribeFuseTuning(const state::Fuse& fuse);

}  // namespace fusekeeper
