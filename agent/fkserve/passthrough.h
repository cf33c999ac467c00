// The reference server's built-in file system: a passthrough of one directory, written against
// the libfuse3 low-level API. Inodes are O_PATH fds held per (st_dev, st_ino) and reference
// counted by the kernel's lookups/forgets; every operation works relative to those fds, never
// re-resolving a path, so a rename or symlink swap inside the export cannot redirect it.
//
// With a mount group (the pod's fsGroup, VOLUME_MOUNT_GROUP), files are *presented* with that
// group and group permissions equal to the owner's, so the pod's processes (which carry the
// fsGroup as a supplementary group) can use them and kubelet never needs to chown.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"

namespace fusekeeper {

struct PassthroughOptions {
  std::string root;                     // the directory to export
  bool read_only = false;
  std::optional<uint32_t> mount_group;  // present files with this gid
};

// Serves the FUSE connection `fuse_fd` (already mounted by the agent) until it ends (unmount or
// abort). Blocks. Takes ownership of fuse_fd.
absl::Status ServePassthrough(int fuse_fd, const PassthroughOptions& options);

}  // namespace fusekeeper
