// Field validation for Node RPCs, as the CSI spec requires it: a missing or malformed field is
// INVALID_ARGUMENT with a message naming the field. Pure functions, thread-safe.
//
// Limits: CSI caps strings at 128 bytes and each map / repeated string field at 4 KiB in total;
// paths are exempt from the 128-byte cap and limited here to PATH_MAX. NUL bytes are refused in
// every string that reaches a syscall.
#pragma once

#include "absl/status/status.h"
#include "proto/csi.pb.h"

namespace fusekeeper {

inline constexpr size_t kCsiMaxStringBytes = 128;
inline constexpr size_t kCsiMaxMapBytes = 4096;
inline constexpr size_t kMaxPathBytes = 4095;

absl::Status ValidateNodeStage(const csi::v1::NodeStageVolumeRequest& req);
absl::Status ValidateNodeUnstage(const csi::v1::NodeUnstageVolumeRequest& req);
absl::Status ValidateNodePublish(const csi::v1::NodePublishVolumeRequest& req);
absl::Status ValidateNodeUnpublish(const csi::v1::NodeUnpublishVolumeRequest& req);
absl::Status ValidateNodeGetVolumeStats(const csi::v1::NodeGetVolumeStatsRequest& req);
absl::Status ValidateNodeExpand(const csi::v1::NodeExpandVolumeRequest& req);

// `field` names the capability in messages (e.g. "volume_capability").
absl::Status ValidateVolumeCapability(const csi::v1::VolumeCapability& cap, absl::string_view field);

}  // namespace fusekeeper
