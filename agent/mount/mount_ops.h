// Mount operations. Every function here blocks (mount-family syscalls, path lookups) and runs on
// the BlockingPool, never on the loop thread. Each returns a Status naming the path and errno.
//
// Binds use the new mount API on file descriptors (open_tree(OPEN_TREE_CLONE) → mount_setattr →
// move_mount), so what is mounted is exactly the object that was opened and checked, and the
// read-only flag is set on the detached copy before it is ever visible.
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"
#include "agent/mount/mountinfo.h"
#include "agent/sys/syscalls.h"

namespace fusekeeper {

struct BindOptions {
  bool read_only = false;
  bool recursive = false;  // AT_RECURSIVE: include submounts of the source
  bool nosuid = false;
  bool nodev = false;
  bool noexec = false;
  // The copy receives the source's mount propagation but sends none back (slave of the source's
  // peer group, and shared in a group of its own so that bind copies of it, such as a
  // container's, follow it). Set before the copy is attached, so no namespace ever sees it as a
  // peer of the source: an unmount on the copy can then never remove mounts from the source.
  bool follow_source = false;
};

// Clones the mount tree at `source_fd` (an O_PATH fd) and attaches it onto `target_fd` (an O_PATH
// fd of an existing directory or file). `what` names the source in errors.
absl::Status BindMountFdBlocking(int source_fd, int target_fd, const BindOptions& options,
                                 const std::string& what, const std::string& target_path);

// Unmounts the topmost mount at `name` inside the directory `parent_fd` (an O_PATH fd), never
// following a symlink there. The caller must hold no fd on the mount itself: an open fd pins a
// mount and makes a plain unmount fail with EBUSY. Plain umount first; on EBUSY (someone has files
// open there) up to `busy_retries` more tries, then a lazy MNT_DETACH. Returns OK, or NOT_FOUND
// (nothing mounted there: EINVAL), or the failure. `path` names the mount point in messages.
absl::Status UnmountAtBlocking(int parent_fd, const std::string& name, const std::string& path,
                               int busy_retries = 2);

// Remounts the mount at fd read-only (or read-write), in place.
absl::Status SetReadOnlyFdBlocking(int fd, bool read_only, const std::string& path);

// Sets propagation (MS_SHARED, MS_PRIVATE, MS_SLAVE or MS_UNBINDABLE) of the mount at fd.
absl::Status SetPropagationFdBlocking(int fd, uint64_t propagation, const std::string& path);

// What is mounted at the path `fd` was opened on: statmount where the kernel has it (O(1)),
// else the whole /proc/self/mountinfo. nullopt if `fd`'s path is not a mount point.
// `path` is the absolute path (as mountinfo shows it) fd was opened on.
absl::StatusOr<std::optional<sys::MountFacts>> LookupMountAtBlocking(int fd, const std::string& path);

// What a /proc/self/mountinfo line says of a mount, as MountFacts (no 64-bit ids: 0).
sys::MountFacts FactsOf(const MountEntry& e);

}  // namespace fusekeeper
