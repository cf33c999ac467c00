// The blocking halves of volume operations that both kinds share (host_path_kind.h,
// fuse_kind.h): binding a staged volume's targets to its staging mount, unpublishing, unstaging,
// stats, re-identifying mounts after a restart, and the mount-point and state helpers the kinds'
// own halves use (host_path_ops.h, fuse_volume_ops.h). Every function here runs on the
// BlockingPool, takes a copy of the volume's state, and returns the new state for the loop to
// adopt. Intent is written first (`pending`), the mount is made on file descriptors, then its
// identity is recorded, so a kill -9 between any two steps is repaired by Reconcile at start-up.
#pragma once

#include <sys/statfs.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"
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

// A non-directory source (file, socket, device) cannot be bound onto the staging directory
// kubelet creates, so it is bound onto this file inside it.
inline constexpr char kStagedFileName[] = "hostpath";

// A path beneath the kubelet dir: relative to it (checked), and absolute as the mount table shows
// it (kubelet dir symlinks resolved).
absl::StatusOr<std::string> Rel(const VolumeOpsContext& ctx, const std::string& path);
std::string Abs(const VolumeOpsContext& ctx, const std::string& rel);

// The identity of the mount at `fd` (opened at `path`), which must be a mount.
absl::StatusOr<state::MountIdentity> IdentifyBlocking(int fd, const std::string& path);
bool SameDevice(const std::optional<sys::MountFacts>& facts, uint32_t major, uint32_t minor);

// Restores what was saved of the volume before a failed operation began (none: removes it).
void RollBack(const VolumeOpsContext& ctx, const std::string& volume_id, const std::optional<state::Volume>& previous);

// Creates the mount point `rel` (a directory, or an empty file for non-directory sources) if
// missing; refuses a symlink or the wrong type. Returns whether it created it.
absl::StatusOr<bool> EnsureMountPointBlocking(const VolumeOpsContext& ctx, const std::string& rel, bool directory);

// Whether `facts` (what is mounted at a path) is the mount `id` describes.
bool MountMatches(const std::optional<sys::MountFacts>& facts, const state::MountIdentity& id);

// What a target is bound from, and its name for messages.
struct PublishSource {
  UniqueFd fd;
  std::string name;
};

// A staged volume's staging mount, checked to be the one recorded (FAILED_PRECONDITION if not).
absl::StatusOr<PublishSource> OpenStagingMountBlocking(const VolumeOpsContext& ctx, const state::Volume& volume);

// Publishes volume.targets(index) by binding `source` there (a staged volume's targets follow
// it: mount_stack.h); a repeat adopts the bind it finds.
absl::StatusOr<state::Volume> PublishBlocking(const VolumeOpsContext& ctx, state::Volume volume, int index,
                                              std::optional<state::Volume> previous, const BindOptions& bind,
                                              PublishSource source);

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
