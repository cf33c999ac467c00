// A path's mount stack as running containers see it (BlockingPool only, except the pure helpers).
//
// Stage and publish make a *base* mount at a path. Running containers hold slave copies of a pod
// target's base (containerd binds the target rslave at another path, in another mount
// namespace), and a staged volume's targets are binds of the global mount that receive its
// propagation. Unmounting a base and mounting a new one in its place never reaches those copies;
// a mount stacked *on top of* the base does (and so does a later umount of it). So a repair never
// removes a base: it removes the dead layers above it, then stacks the live connection on it.
// A path therefore holds the base and at most one repair layer.
//
// Umount propagates to the peers of the mount it is made on. Targets are bound as slaves of the
// global mount (shared again, so containers follow them): removing a target's top layer then
// reaches only that target and its containers, never the global mount or the other pods.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/sys/syscalls.h"
#include "proto/state.pb.h"

namespace fusekeeper {

// At most this many layers are looked at (or removed) on one path.
constexpr int kMaxMountLayers = 16;

// The recorded base of a target / the global mount: `base` when set, else the recorded mount.
const state::MountIdentity& TargetBase(const state::Target& t);
const state::MountIdentity& StagingBase(const state::Volume& v);

// The recorded top layer and base of `path`, the volume's staging path or one of its targets
// (empty identities for a path the volume does not have).
struct PathMounts {
  state::MountIdentity top, base;
};
PathMounts MountsAt(const state::Volume& v, const std::string& path);

state::MountIdentity IdentityOf(const sys::MountFacts& f);
bool IsFuseFsType(const std::string& fs_type);
// Same superblock (device) as `id`.
bool SameDev(const sys::MountFacts& f, const state::MountIdentity& id);
// Exactly the mount `id` recorded: by unique id where both are known, else by device and root.
bool IsMount(const sys::MountFacts& f, const state::MountIdentity& id);
// Whether a container that follows `base` reads through `top` (the top mount of the path): it is
// the base itself, or a mount stacked directly on it. Needs unique ids (statmount); without them
// it says yes.
bool VisibleThroughBase(const sys::MountFacts& top, const state::MountIdentity& base);

// Mount ids (statx's STATX_MNT_ID_UNIQUE, statmount's mnt_id and parent id) belong to one mount
// namespace: every mount copied into a new namespace gets a new id. The agent's container is a
// new mount namespace at each restart (every DaemonSet rollout), so ids saved by an earlier agent
// mean nothing to this one. What survives a namespace copy is the device, the root and the
// position in the path's stack. ReidentifyBlocking gives the recorded identities of `path` the
// ids of this namespace: `base` is the lowest layer with its device and root, `top` (when it is
// a layer of its own, i.e. `base` is not null) the highest one above it. An identity not found
// at the path gets id 0 (unknown: comparisons then use device and root only). Returns whether
// anything changed.
bool ReidentifyBlocking(const KubeletDir& kubelet, const std::string& path, state::MountIdentity* top,
                        state::MountIdentity* base);

// What is mounted on top of `path` (nullopt: nothing, or the path itself is gone).
absl::StatusOr<std::optional<sys::MountFacts>> TopOfBlocking(const KubeletDir& kubelet, const std::string& path);

// Every mount stacked at `path` right now, top first (statmount: the top's parents while they
// are mounted at the same point; without it, /proc/self/mountinfo).
absl::StatusOr<std::vector<sys::MountFacts>> LayersAtBlocking(const KubeletDir& kubelet, const std::string& path);

// Aborts the FUSE connections `minors` (fusectl), each only if a FUSE mount of it is at `path`
// right now: a saved connection number proves nothing after a reboot (numbers are reused), and
// aborting someone else's connection kills their file system.
void AbortConnectionsAtBlocking(const KubeletDir& kubelet, const std::string& path,
                                const std::vector<uint32_t>& minors);

struct Stripped {
  std::optional<sys::MountFacts> top;  // the top after stripping
  bool live = false;                   // the top is on the live connection: nothing to stack
  bool at_base = false;                // the top is the base: stack the live connection on it
  int removed = 0;                     // dead layers unmounted
};

// Unmounts dead layers from the top of `path` until its top is on the live connection (same
// device as `live`, if given) or is the base. The base is `base` by device and root, or, whatever
// the records say, the lowest mount at the path: running containers may hold copies of it, and
// nothing proves it dead, so it is never removed (at_base; `top` then says what it is). Only
// FUSE mounts are removed: anything else on top is left alone and reported
// (FAILED_PRECONDITION), as is a stack deeper than kMaxMountLayers. Nothing mounted at the path:
// both flags false.
absl::StatusOr<Stripped> StripToBaseBlocking(const KubeletDir& kubelet, const std::string& path,
                                             const state::MountIdentity& base,
                                             const std::optional<state::MountIdentity>& live);

// Unmounts every layer of ours at `path`, top first: mounts matching `top` or `base` (device and
// root; a bind of the same source is ours even if a restart lost its unique id) and, while the
// base is still there, FUSE layers between them (`fuse_layers`). A foreign mount on top is left
// alone: FAILED_PRECONDITION. Nothing mounted: OK.
absl::Status UnmountStackBlocking(const KubeletDir& kubelet, const std::string& path,
                                  const state::MountIdentity& top, const state::MountIdentity& base,
                                  bool fuse_layers);

}  // namespace fusekeeper
