// The blocking halves of FUSE volume operations (BlockingPool only). A FUSE volume is mounted by
// the agent (a fresh /dev/fuse connection, fd=N) on its staging path or, for an unstaged inline
// volume, on the pod's target path; its handoff socket is created where the server can reach it:
// the pod's emptyDir (inline volumes, a sidecar server) or the agent's socket dir (staged volumes,
// a node-level server). Nothing here ever waits on the FUSE server.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"
#include "agent/volume/volume_ops.h"
#include "proto/state.pb.h"

namespace fusekeeper {

struct FuseMounted {
  state::Volume volume;  // with the new mount's identity recorded
  UniqueFd fuse_fd;      // the agent's own fd on the connection (for the handoff endpoint)
  UniqueFd listen_fd;    // the handoff socket, listening
};

// target_index < 0: mount at the staging path; else at volume.targets(target_index).
// volume.fuse().socket_path() must be set; `socket_in_kubelet_dir` says it is a pod's emptyDir
// (opened beneath the kubelet dir without symlinks; owned by root or the server's uid).
absl::StatusOr<FuseMounted> MountFuseVolumeBlocking(const VolumeOpsContext& ctx, state::Volume volume,
                                                    int target_index, std::optional<state::Volume> previous,
                                                    bool socket_in_kubelet_dir);

// Ends the FUSE mount at `path` (RPC form): aborts the connection (so no process and no agent
// thread can stay blocked on it), unmounts it, removes the handoff socket. Idempotent.
absl::Status TearDownFuseMountBlocking(const VolumeOpsContext& ctx, const std::string& path,
                                       const state::MountIdentity& id, const state::Volume& volume,
                                       bool socket_in_kubelet_dir);

// --- Recovery (BlockingPool only) ---

struct FuseRemounted {
  state::Volume volume;  // with the fresh mount's identity recorded (and saved)
  UniqueFd fuse_fd;      // the agent's fd on the fresh connection
  int replaced = 0;      // how many of our old FUSE mounts were removed from the path first
};

// Replaces the volume's FUSE mount (at the staging path, or at an inline volume's target) with a
// fresh connection: aborts and unmounts our old connection's mount(s) there (stacked copies
// included; a mount that is not ours is left alone and reported), then mounts a fresh one.
absl::StatusOr<FuseRemounted> RemountFuseBlocking(const VolumeOpsContext& ctx, state::Volume volume);

struct RebindOutcome {
  state::Volume volume;               // with the new target mounts recorded (and saved)
  std::vector<std::string> rebound;   // targets bound again onto the current global mount
  std::vector<std::string> skipped;   // targets whose pod directory is gone: left alone
  std::vector<std::string> failed;    // "path: why"
  int stacked_removed = 0;            // mounts removed beyond one per rebound target
};

// Staged volumes: every target whose top mount is not the volume's current staging mount (its
// superblock differs: the global mount was replaced) is unmounted down to the path (stacked
// copies included, at most kMaxStacked) and bound again from the staging mount.
absl::StatusOr<RebindOutcome> RebindTargetsBlocking(const VolumeOpsContext& ctx, state::Volume volume);

// The volume's handoff socket, made again (an agent restarted without its endpoints).
absl::StatusOr<UniqueFd> ListenForServerBlocking(const VolumeOpsContext& ctx, const state::Volume& volume);

// The identity of whatever is mounted on top of `path` now (nullopt: nothing).
absl::StatusOr<std::optional<state::MountIdentity>> TopMountBlocking(const VolumeOpsContext& ctx,
                                                                    const std::string& path);

}  // namespace fusekeeper
