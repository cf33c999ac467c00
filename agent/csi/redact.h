// Log-safe rendering of CSI messages: every field marked (csi.v1.csi_secret) and every mount flag
// (which may carry credentials) has its values replaced by "<redacted>". Keys stay visible so
// operators can see which secrets were passed.
#pragma once

#include <string>

#include "google/protobuf/message.h"
#include "proto/csi.pb.h"

namespace fusekeeper {

// Thread-safe; copies the message.
std::string RedactedDebugString(const google::protobuf::Message& message);

// The one log line's worth of a Node RPC: the volume id and the paths (and, for a publish, the
// pod), read field by field without copying the message. Nothing else is read, so no secret or
// mount flag can appear. Other messages: their RedactedDebugString. Thread-safe.
std::string RpcSummary(const csi::v1::NodeStageVolumeRequest& r);
std::string RpcSummary(const csi::v1::NodeUnstageVolumeRequest& r);
std::string RpcSummary(const csi::v1::NodePublishVolumeRequest& r);
std::string RpcSummary(const csi::v1::NodeUnpublishVolumeRequest& r);
std::string RpcSummary(const csi::v1::NodeGetVolumeStatsRequest& r);
std::string RpcSummary(const csi::v1::NodeExpandVolumeRequest& r);
inline std::string RpcSummary(const google::protobuf::Message& m) { return RedactedDebugString(m); }

}  // namespace fusekeeper
