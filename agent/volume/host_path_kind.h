// The hostPath volume kind: a directory, file, socket or device of the node, bound into the pod
// (volume_context: kind=hostPath, path, type as in Kubernetes' hostPath volumes). Staged volumes
// are bound at the staging path and from there into each target; unstaged (CSI inline) ones come
// straight from the host path, and only from below --ephemeral_host_path_prefixes. The blocking
// halves are in volume_ops.h.
#pragma once

#include "agent/volume/volume_kind.h"

namespace fusekeeper {


// Validates a hostPath volume's volume_context (path, type) and capability (bind mount flags,
// volume_mount_group) and fills spec's host_path and host_path_type. Pure; any thread.
absl::Status ParseHostPathSpec(const google::protobuf::Map<std::string, std::string>& volume_context,
                               const csi::v1::VolumeCapability& cap, state::Spec* spec);

class HostPathKind final : public VolumeKind {
 public:
  explicit HostPathKind(VolumeHost& host) : VolumeKind(host) {}

  absl::string_view name() const override { return kHostPathKind; }
  absl::Status ParseSpec(const google::protobuf::Map<std::string, std::string>& volume_context,
                         const csi::v1::VolumeCapability& cap, bool staged, state::Spec* spec) const override;
  void ApplySpec(const state::Spec& spec, state::Volume* v) const override;
  absl::StatusOr<KindJob> Stage(StageCall call) override;
  absl::Status CheckPublish(const csi::v1::NodePublishVolumeRequest& req, const state::Volume* staged,
                            const state::Spec& spec, bool* read_only) const override;
  absl::StatusOr<KindJob> Publish(PublishCall call) override;
  KindJob Unpublish(const state::Volume& v, const state::Target& t) override;
  KindJob Unstage(const state::Volume& v) override;
};

}  // namespace fusekeeper
