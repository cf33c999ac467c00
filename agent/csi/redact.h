// Log-safe rendering of CSI messages: every field marked (csi.v1.csi_secret) and every mount flag
// (which may carry credentials) has its values replaced by "<redacted>". Keys stay visible so
// operators can see which secrets were passed.
#pragma once

#include <string>

#include "google/protobuf/message.h"

namespace fusekeeper {

// Thread-safe; copies the message.
std::string RedactedDebugString(const google::protobuf::Message& message);

}  // namespace fusekeeper
