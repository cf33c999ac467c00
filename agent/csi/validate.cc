#include "agent/csi/validate.h"

#include "absl/strings/str_cat.h"

namespace fusekeeper {
namespace {

using csi::v1::VolumeCapability;
using google::protobuf::Map;

absl::Status Required(absl::string_view field) {
  return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
}

absl::Status CheckId(const std::string& value, absl::string_view field) {
  if (value.empty()) return Required(field);
  if (value.size() > kCsiMaxStringBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is ", value.size(),
                                                   " bytes; CSI allows at most ", kCsiMaxStringBytes));
  }
  if (value.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, " contains a NUL byte"));
  }
  return absl::OkStatus();
}

absl::Status CheckPath(const std::string& value, absl::string_view field, bool required) {
  if (value.empty()) return required ? Required(field) : absl::OkStatus();
  if (value.size() > kMaxPathBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", value.size(), " bytes; the limit is ", kMaxPathBytes));
  }
  if (value.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, " contains a NUL byte"));
  }
  if (value[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be an absolute path"));
  }
  return absl::OkStatus();
}

absl::Status CheckMap(const Map<std::string, std::string>& map, absl::string_view field) {
  size_t total = 0;
  for (const auto& [k, v] : map) total += k.size() + v.size();
  if (total > kCsiMaxMapBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " holds ", total, " bytes; CSI allows at most ", kCsiMaxMapBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckCapability(bool has, const VolumeCapability& cap, absl::string_view field) {
  if (!has) return Required(field);
  return ValidateVolumeCapability(cap, field);
}

}  // namespace

absl::Status ValidateVolumeCapability(const VolumeCapability& cap, absl::string_view field) {
  switch (cap.access_type_case()) {
    case VolumeCapability::kMount:
      break;
    case VolumeCapability::kBlock:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".block: block volumes are not supported; fusekeeper serves file systems "
                 "(use access_type mount / volumeMode: Filesystem)"));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".access_type is required (mount)"));
  }
  size_t flag_bytes = 0;
  for (const std::string& flag : cap.mount().mount_flags()) {
    flag_bytes += flag.size();
    if (flag.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".mount.mount_flags contains a NUL byte"));
    }
  }
  if (flag_bytes > kCsiMaxMapBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".mount.mount_flags hold ", flag_bytes,
                                                   " bytes; CSI allows at most ", kCsiMaxMapBytes));
  }
  if (cap.mount().fs_type().size() > kCsiMaxStringBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".mount.fs_type is too long"));
  }
  if (!cap.has_access_mode()) return Required(absl::StrCat(field, ".access_mode"));
  const int mode = cap.access_mode().mode();
  if (mode == VolumeCapability::AccessMode::UNKNOWN ||
      !VolumeCapability::AccessMode::Mode_IsValid(mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".access_mode.mode ", mode, " is not a known access mode"));
  }
  return absl::OkStatus();
}

absl::Status ValidateNodeStage(const csi::v1::NodeStageVolumeRequest& req) {
  if (auto s = CheckId(req.volume_id(), "volume_id"); !s.ok()) return s;
  if (auto s = CheckPath(req.staging_target_path(), "staging_target_path", true); !s.ok()) return s;
  if (auto s = CheckCapability(req.has_volume_capability(), req.volume_capability(),
                               "volume_capability");
      !s.ok())
    return s;
  if (auto s = CheckMap(req.volume_context(), "volume_context"); !s.ok()) return s;
  if (auto s = CheckMap(req.publish_context(), "publish_context"); !s.ok()) return s;
  return CheckMap(req.secrets(), "secrets");
}

absl::Status ValidateNodeUnstage(const csi::v1::NodeUnstageVolumeRequest& req) {
  if (auto s = CheckId(req.volume_id(), "volume_id"); !s.ok()) return s;
  return CheckPath(req.staging_target_path(), "staging_target_path", true);
}

absl::Status ValidateNodePublish(const csi::v1::NodePublishVolumeRequest& req) {
  if (auto s = CheckId(req.volume_id(), "volume_id"); !s.ok()) return s;
  if (auto s = CheckPath(req.target_path(), "target_path", true); !s.ok()) return s;
  if (auto s = CheckCapability(req.has_volume_capability(), req.volume_capability(),
                               "volume_capability");
      !s.ok())
    return s;
  // Empty for ephemeral inline volumes, which kubelet never stages.
  if (auto s = CheckPath(req.staging_target_path(), "staging_target_path", false); !s.ok()) return s;
  if (auto s = CheckMap(req.volume_context(), "volume_context"); !s.ok()) return s;
  if (auto s = CheckMap(req.publish_context(), "publish_context"); !s.ok()) return s;
  return CheckMap(req.secrets(), "secrets");
}

absl::Status ValidateNodeUnpublish(const csi::v1::NodeUnpublishVolumeRequest& req) {
  if (auto s = CheckId(req.volume_id(), "volume_id"); !s.ok()) return s;
  return CheckPath(req.target_path(), "target_path", true);
}

absl::Status ValidateNodeGetVolumeStats(const csi::v1::NodeGetVolumeStatsRequest& req) {
  if (auto s = CheckId(req.volume_id(), "volume_id"); !s.ok()) return s;
  // Only presence here: for a volume this node does not know the spec (and csi-sanity) want
  // NOT_FOUND whatever the path looks like, and a known volume not mounted at the path is
  // NOT_FOUND too (the manager compares the path with where it mounted the volume).
  if (req.volume_path().empty()) return absl::InvalidArgumentError("volume_path is required");
  return CheckPath(req.staging_target_path(), "staging_target_path", false);
}

absl::Status ValidateNodeExpand(const csi::v1::NodeExpandVolumeRequest& req) {
  if (auto s = CheckId(req.volume_id(), "volume_id"); !s.ok()) return s;
  return CheckPath(req.volume_path(), "volume_path", true);
}

}  // namespace fusekeeper
