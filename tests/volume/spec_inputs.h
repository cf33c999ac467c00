// volume_context maps and capabilities for the volume_context parsing tests.
#pragma once

#include <initializer_list>
#include <string>
#include <utility>

#include "google/protobuf/map.h"
#include "proto/csi.pb.h"

namespace fusekeeper {

inline google::protobuf::Map<std::string, std::string> Context(
    std::initializer_list<std::pair<const char*, const char*>> kv) {
  google::protobuf::Map<std::string, std::string> m;
  for (const auto& [k, v] : kv) m[k] = v;
  return m;
}

// A mount capability with these flags and volume_mount_group.
inline csi::v1::VolumeCapability Cap(std::initializer_list<const char*> flags = {}, const char* group = "") {
  csi::v1::VolumeCapability cap;
  for (const char* f : flags) cap.mutable_mount()->add_mount_flags(f);
  cap.mutable_mount()->set_volume_mount_group(group);
  return cap;
}

}  // namespace fusekeeper
