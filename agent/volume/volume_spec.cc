#include "agent/volume/volume_spec.h"

#include "absl/strings/str_cat.h"
#include "agent/volume/state_store.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace fusekeeper {

using csi::v1::VolumeCapability;

std::string ContextValue(const google::protobuf::Map<std::string, std::string>& ctx, const char* key) {
  auto it = ctx.find(key);
  return it == ctx.end() ? "" : it->second;
}

absl::StatusOr<uint32_t> ParseId(const std::string& value, absl::string_view what) {
  if (value.empty() || value.size() > 10 || value.find_first_not_of("0123456789") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", value, "' is not a numeric id"));
  }
  uint64_t v = std::stoull(value);
  if (v > UINT32_MAX) return absl::InvalidArgumentError(absl::StrCat(what, " '", value, "' is out of range"));
  return static_cast<uint32_t>(v);
}

absl::Status CheckName(const std::string& name, absl::string_view what) {
  if (name.empty() || name.size() > 253 || name == "." || name == ".." ||
      name.find_first_of("/\0", 0, 2) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", name, "' is not a valid name"));
  }
  return absl::OkStatus();
}

bool ReadOnlyRequested(const VolumeCapability& cap, bool readonly) {
  const auto mode = cap.access_mode().mode();
  return readonly || mode == VolumeCapability::AccessMode::SINGLE_NODE_READER_ONLY ||
         mode == VolumeCapability::AccessMode::MULTI_NODE_READER_ONLY;
}

absl::StatusOr<BindOptions> ParseBindOptions(const VolumeCapability& cap, bool readonly, absl::string_view kind) {
  BindOptions o;
  o.read_only = ReadOnlyRequested(cap, readonly);
  const auto& flags = cap.mount().mount_flags();
  for (int i = 0; i < flags.size(); ++i) {
    const std::string& f = flags[i];
    if (f == "ro") {
      o.read_only = true;
    } else if (f == "rw" || f == "bind" || f == "defaults") {
    } else if (f == "nosuid") {
      o.nosuid = true;
    } else if (f == "nodev") {
      o.nodev = true;
    } else if (f == "noexec") {
      o.noexec = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "mount flag #", i + 1, " is not supported for ", kind,
          " volumes (supported: ro, rw, nosuid, nodev, noexec)"));
    }
  }
  return o;
}

std::string RequestFingerprint(state::Spec s, const VolumeCapability& cap, bool readonly,
                               const std::string& staging_path) {
  s.mutable_fuse();  // present even when empty, as earlier agents hashed it
  s.set_access_mode(cap.access_mode().mode());
  for (const auto& f : cap.mount().mount_flags()) s.add_mount_flags(f);
  s.set_volume_mount_group(cap.mount().volume_mount_group());
  s.set_readonly(readonly);
  s.set_staging_path(staging_path);
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  {
    google::protobuf::io::CodedOutputStream out(&stream);
    out.SetSerializationDeterministic(true);
    s.SerializeToCodedStream(&out);
  }
  return Sha256Hex(bytes);
}

state::Spec StagedSpec(const state::Volume& v, const std::string& kind) {
  state::Spec s;
  s.set_kind(kind);
  s.set_host_path(v.host_path());
  s.set_host_path_type(v.host_path_type());
  *s.mutable_fuse() = v.fuse();
  s.mutable_fuse()->clear_socket_path();
  return s;
}

}  // namespace fusekeeper
