#include "agent/volume/volume_spec.h"

#include "absl/strings/str_cat.h"

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

absl::StatusOr<BindOptions> ParseBindOptions(const VolumeCapability& cap, bool readonly, absl::string_view kind) {
  BindOptions o;
  o.read_only = readonly ||
                cap.access_mode().mode() == VolumeCapability::AccessMode::SINGLE_NODE_READER_ONLY ||
                cap.access_mode().mode() == VolumeCapability::AccessMode::MULTI_NODE_READER_ONLY;
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

}  // namespace fusekeeper
