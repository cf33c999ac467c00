#include "agent/volume/host_path_kind.h"

#include "absl/strings/str_cat.h"
#include "agent/paths/host_path.h"
#include "agent/volume/host_path_ops.h"
#include "agent/volume/volume_spec.h"
#include "glog/logging.h"

namespace fusekeeper {

absl::Status HostPathKind::ParseSpec(const google::protobuf::Map<std::string, std::string>& ctx,
                                     const csi::v1::VolumeCapability& cap, bool, state::Spec* spec) const {
  return ParseHostPathSpec(ctx, cap, spec);
}

absl::Status ParseHostPathSpec(const google::protobuf::Map<std::string, std::string>& ctx,
                               const csi::v1::VolumeCapability& cap, state::Spec* spec) {
  const std::string path = ContextValue(ctx, "path");
  const std::string type = ContextValue(ctx, "type");
  if (path.empty()) return absl::InvalidArgumentError("volume_context.path is required for hostPath");
  if (auto s = ValidateHostPath(path); !s.ok()) return s;
  if (auto t = ParseHostPathType(type); !t.ok()) return t.status();
  if (auto b = ParseBindOptions(cap, false, kHostPathKind); !b.ok()) return b.status();
  const std::string& group = cap.mount().volume_mount_group();
  if (!group.empty()) {
    // A bind mount cannot re-present ownership; kubelet does not chown either (fsGroup is
    // delegated to us), so say so rather than pretend.
    if (auto g = ParseId(group, "volume_mount_group"); !g.ok()) return g.status();
    LOG(WARNING) << "hostPath volumes do not apply volume_mount_group (fsGroup " << group
                 << "): files keep their owners";
  }
  spec->set_host_path(path);
  spec->set_host_path_type(type);
  return absl::OkStatus();
}

void HostPathKind::ApplySpec(const state::Spec& spec, state::Volume* v) const {
  v->set_kind(kHostPathKind);
  v->set_host_path(spec.host_path());
  v->set_host_path_type(spec.host_path_type());
}

absl::StatusOr<KindJob> HostPathKind::Stage(StageCall call) {
  // A repeat runs again too: StageHostPathBlocking adopts the mount it finds, or makes a lost one again.
  auto bind = ParseBindOptions(call.req->volume_capability(), false, kHostPathKind);
  if (!bind.ok()) return bind.status();
  return StateJob("NodeStageVolume",
                  [ctx = host_.ops_context(), v = std::move(call.volume), previous = std::move(call.previous),
                   bind = *bind]() mutable -> absl::StatusOr<std::optional<state::Volume>> {
                    auto r = StageHostPathBlocking(ctx, std::move(v), std::move(previous), bind);
                    if (!r.ok()) return r.status();
                    return std::optional<state::Volume>(std::move(*r));
                  });
}

absl::Status HostPathKind::CheckPublish(const csi::v1::NodePublishVolumeRequest& req, const state::Volume* staged,
                                        const state::Spec& spec, bool* read_only) const {
  const VolumeOpsContext& ctx = host_.ops_context();
  if (staged == nullptr && !EphemeralHostPathAllowed(ctx, spec.host_path())) {
    // Unstaged host-path volumes are chosen by pod authors (CSI inline volumes), not by the
    // administrator who creates PersistentVolumes: only allowed below configured prefixes.
    return absl::PermissionDeniedError(absl::StrCat(
        "unstaged (ephemeral inline) hostPath volumes may only use paths below "
        "--ephemeral_host_path_prefixes", ctx.ephemeral_host_path_prefixes.empty() ? " (none set)" : "",
        "; ", spec.host_path(), " is not"));
  }
  auto bind = ParseBindOptions(req.volume_capability(), req.readonly(), kHostPathKind);
  if (!bind.ok()) return bind.status();
  *read_only = bind->read_only;
  return absl::OkStatus();
}

absl::StatusOr<KindJob> HostPathKind::Publish(PublishCall call) {
  // A repeat of a completed publish re-checks the mount (PublishBlocking adopts it).
  auto bind = ParseBindOptions(call.req->volume_capability(), call.req->readonly(), kHostPathKind);
  if (!bind.ok()) return bind.status();
  return StateJob("NodePublishVolume",
                  [ctx = host_.ops_context(), v = std::move(call.volume), index = call.index,
                   previous = std::move(call.previous), bind = *bind]() mutable
                  -> absl::StatusOr<std::optional<state::Volume>> {
                    // From the staging mount, or (ephemeral) the host path itself.
                    auto source = v.staging_path().empty() ? OpenEphemeralHostPathBlocking(ctx, &v)
                                                           : OpenStagingMountBlocking(ctx, v);
                    if (!source.ok()) return source.status();
                    auto r = PublishBlocking(ctx, std::move(v), index, std::move(previous), bind, std::move(*source));
                    if (!r.ok()) return r.status();
                    return std::optional<state::Volume>(std::move(*r));
                  });
}

KindJob HostPathKind::Unpublish(const state::Volume& v, const state::Target& t) {
  return StateJob("NodeUnpublishVolume", [ctx = host_.ops_context(), v, path = t.path()]() mutable {
    return UnpublishBlocking(ctx, std::move(v), path);
  });
}

KindJob HostPathKind::Unstage(const state::Volume& v) {
  return StateJob("NodeUnstageVolume",
                  [ctx = host_.ops_context(), v]() -> absl::StatusOr<std::optional<state::Volume>> {
                    if (auto s = UnstageBlocking(ctx, v); !s.ok()) return s;
                    return std::optional<state::Volume>();
                  });
}

}  // namespace fusekeeper
