// The blocking halves of the Node RPCs for host-path volumes. Every function here runs on the
// BlockingPool, takes a copy of the volume's state, and returns the new state for the loop to
// adopt. Intent is written first (`pending`), the mount is made on file descriptors, then its
// identity is recorded, so a kill -9 between any two steps is repaired by Reconcile at start-up.
#pragma once

#include <sys/statfs.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agent/mount/mount_ops.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/volume/mount_stack.h"
#include "agent/volume/state_store.h"
#include "proto/csi.pb.h"
#include "proto/state.pb.h"

namespace fusekeeper {

struct VolumeOpsContext {
  const KubeletDir* kubelet;
  const StateStore* store;
  // Where unstaged (ephemeral inline) host-path volumes may come from; empty: nowhere. A pod
  // author chooses those paths, so the opened object's real path must be below one of these.
  std::vector<std::string> ephemeral_host_path_prefixes;
  // Where the node's root is in the agent's view ("": the agent runs in the node's root); host
  // paths resolve beneath it (see OpenHostPathBlocking).
  std::string host_root;
};

// Whether an unstaged host-path volume may come from `path` (see ephemeral_host_path_prefixes).
bool EphemeralHostPathAllowed(const VolumeOpsContext& ctx, const std::string& path);

// Whether `facts` (what is mounted at a path) is the mount `id` describes.
bool MountMatches(const std::optional<sys::MountFacts>& facts, const state::MountIdentity& id);

// Stages `volume` (host_path, host_path_type and staging_path set) at its staging path.
// `existed`: whether a previous state of this volume was saved (to restore it on failure).
absl::StatusOr<state::Volume> StageBlocking(const VolumeOpsContext& ctx, state::Volume volume,
                                            std::optional<state::Volume> previous,
                                            const BindOptions& bind);

// Publishes volume.targets(index). For a staged volume the source is its staging mount, for an
// unstaged (ephemeral) one the host path itself.
absl::StatusOr<state::Volume> PublishBlocking(const VolumeOpsContext& ctx, state::Volume volume,
                                              int index, std::optional<state::Volume> previous,
                                              const BindOptions& bind);

// Unmounts and removes target `path` of `volume`. Returns the remaining state, or nullopt if the
// volume has nothing left (its state file is then removed).
absl::StatusOr<std::optional<state::Volume>> UnpublishBlocking(const VolumeOpsContext& ctx,
                                                               state::Volume volume,
                                                               const std::string& path);

// Unmounts the staging mount and removes the volume's state.
absl::Status UnstageBlocking(const VolumeOpsContext& ctx, const state::Volume& volume);

// For a path no volume knows: OK if nothing is mounted there (removing an empty directory left
// behind), NOT_FOUND if something is mounted that fusekeeper did not make.
absl::Status ForgetUnknownPathBlocking(const VolumeOpsContext& ctx, const std::string& path,
                                       const std::string& volume_id, bool remove_dir);

// Bytes and inodes of the mount at `path`, which must be the recorded top `mounts.top` and lie
// where running containers see it (the base itself, or stacked on it: VisibleThroughBase); a
// missing, foreign or unreachable mount is reported as an abnormal condition, not an error.
absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse> StatsBlocking(const VolumeOpsContext& ctx,
                                                                  const std::string& path,
                                                                  const PathMounts& mounts);

// statfs numbers as CSI's int64 usage fields: products that do not fit (a FUSE server may say
// "2^40 blocks of 16 MiB", s3fs does) are INT64_MAX, never an overflow; a free count above the
// total is used 0.
struct StatfsUsage {
  int64_t total_bytes = 0, available_bytes = 0, used_bytes = 0;
  int64_t total_inodes = 0, available_inodes = 0, used_inodes = 0;
};
StatfsUsage UsageOf(const struct statfs& sf);

// After a start-up: gives every recorded mount identity of `v` (staging and targets, top and
// base) the ids of this agent's mount namespace (ReidentifyBlocking; a restarted agent's
// container is a new namespace). Returns whether anything changed.
bool ReidentifyVolumeBlocking(const VolumeOpsContext& ctx, state::Volume* v);

}  // namespace fusekeeper
