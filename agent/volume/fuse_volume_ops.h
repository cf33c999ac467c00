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

// A volume's handoff socket, listening, and the device of the directory it was made in. A mount
// on that directory made after it (the tmpfs of a Memory emptyDir, which the kubelet mounts on a
// directory it made first) hides the socket from the server: the device then differs.
struct HandoffSocket {
  UniqueFd listen_fd;
  uint32_t dir_major = 0, dir_minor = 0;
};

struct FuseMounted {
  state::Volume volume;  // with the new mount's identity recorded
  UniqueFd fuse_fd;      // the agent's own fd on the connection (for the handoff endpoint)
  HandoffSocket socket;
};

// The path of the volume's FUSE mount: the global mount, or an inline volume's only target
// ("" for neither).
std::string FuseMountPath(const state::Volume& v);

// target_index < 0: mount at the staging path; else at volume.targets(target_index).
// volume.fuse().socket_path() must be set; `socket_in_kubelet_dir` says it is a pod's emptyDir
// (opened beneath the kubelet dir without symlinks; owned by root or the server's uid).
absl::StatusOr<FuseMounted> MountFuseVolumeBlocking(const VolumeOpsContext& ctx, state::Volume volume,
                                                    int target_index, std::optional<state::Volume> previous,
                                                    bool socket_in_kubelet_dir);

// Ends the FUSE mount at `path` (RPC form): removes the handoff socket, aborts the connections
// of the top layer `id` and the base (so no process and no agent thread can stay blocked on
// them), and unmounts every layer of ours (mount_stack.h). A foreign mount on top is left alone.
// Idempotent.
absl::Status TearDownFuseMountBlocking(const VolumeOpsContext& ctx, const std::string& path,
                                       const state::MountIdentity& id, const state::MountIdentity& base,
                                       const state::Volume& volume, bool socket_in_kubelet_dir);

// --- Recovery (BlockingPool only) ---

struct FuseRemounted {
  state::Volume volume;  // with the fresh mount's identity recorded (and saved)
  UniqueFd fuse_fd;      // the agent's fd on the fresh connection
  int removed = 0;       // dead layers removed from the path first
};

// Gives the volume's FUSE mount (at the staging path, or at an inline volume's target) a fresh
// connection, stacked on the base (mount_stack.h) so that running containers see it: aborts the
// old connections, removes dead layers above the base (a mount that is not ours is left alone
// and reported), then mounts the fresh connection on the base.
absl::StatusOr<FuseRemounted> RemountFuseBlocking(const VolumeOpsContext& ctx, state::Volume volume);

struct RebindOutcome {
  state::Volume volume;               // with the new target mounts recorded (and saved)
  std::vector<std::string> rebound;   // targets bound again onto the current global mount
  std::vector<std::string> skipped;   // targets whose pod directory is gone: left alone
  std::vector<std::string> failed;    // "path: why"
  int stacked_removed = 0;            // mounts removed beyond one per rebound target
};

// Staged volumes: every target whose top mount is not on the live global connection gets its
// dead layers removed down to its base, then the live global mount bound on top of that base
// (unless propagation from the global mount has already put it there). The base is never
// removed: running containers hold copies of it.
absl::StatusOr<RebindOutcome> RebindTargetsBlocking(const VolumeOpsContext& ctx, state::Volume volume);

// A server pod's handoff socket, `socket_name` in its emptyDir `empty_dir` (found through the
// kubelet dir: <kubelet>/pods/<pod_uid>/volumes/kubernetes.io~empty-dir/<empty_dir>, opened
// without following symlinks, owned by root or the server's uid). NOT_FOUND until the kubelet
// has made the directory.
absl::StatusOr<UniqueFd> ListenInServerPodBlocking(const VolumeOpsContext& ctx, const state::Volume& volume,
                                                   const std::string& pod_uid, const std::string& empty_dir,
                                                   const std::string& socket_name);

// The volume's handoff socket, made again (an agent restarted without its endpoints, or a
// mount on its directory hid it).
absl::StatusOr<HandoffSocket> ListenForServerBlocking(const VolumeOpsContext& ctx, const state::Volume& volume);

}  // namespace fusekeeper
