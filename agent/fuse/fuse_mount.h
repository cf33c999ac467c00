// FUSE connections: the privileged half. The agent opens /dev/fuse, mounts that connection at a
// directory, and (agent/fuse/handoff, next) passes the fd to an unprivileged server that serves
// /dev/fd/N. Until a server reads the fd, any access to the mount point that needs the file
// system blocks: nothing here touches the mount after creating it.
//
// All functions block (device open, mount syscalls, fusectl) and run on the BlockingPool.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"

namespace fusekeeper {

struct FuseMountOptions {
  std::string subtype = "fusekeeper";  // file system type shown as fuse.<subtype>
  std::string source;                  // mountinfo's source field (e.g. the volume id)
  uint32_t user_id = 0;                // owner of the connection (kernel option user_id)
  uint32_t group_id = 0;               // kernel option group_id
  bool allow_other = true;             // pods run as other users than the server
  bool default_permissions = true;     // the kernel checks modes; the server need not
  bool read_only = false;
  bool noexec = false;
  bool noatime = false;
  uint32_t max_read = 0;               // 0: kernel default
};

// Opens /dev/fuse read-write, close-on-exec. A clear error if the device is missing or denied.
absl::StatusOr<UniqueFd> OpenFuseDeviceBlocking();

// Mounts the connection `fuse_fd` on the directory `target_fd` (O_PATH). Uses the new mount API
// (fsopen/fsconfig/fsmount/move_mount; nosuid, nodev, and ro if asked, are set before the mount is
// visible), falling back to mount(2) with "fd=N,..." where the kernel lacks it. `target_path`
// names the mount point in messages.
absl::Status MountFuseBlocking(int fuse_fd, int target_fd, const std::string& target_path,
                               const FuseMountOptions& options);

// Which connection a /dev/fuse fd is on: the `fuse_connection:` line of /proc/self/fdinfo/<fd>
// (the minor of the mount's device; Linux 6.x). nullopt: the kernel does not say (older kernels,
// or an fd not yet mounted). Reads procfs only: never waits on a FUSE server.
absl::StatusOr<std::optional<uint32_t>> FuseConnectionOfFd(int fd);

// The fusectl directory of connection `dev_minor` (a FUSE mount's st_dev minor; major is 0).
std::string FuseConnectionDir(uint32_t dev_minor);

// The fusectl directory of the connection, mounting fusectl at /sys/fs/fuse/connections first if
// it is not there. NOT_FOUND if no such connection exists (already gone).
absl::StatusOr<std::string> OpenFuseConnectionDirBlocking(uint32_t dev_minor);

// Aborts a FUSE connection through fusectl (mounting fusectl at /sys/fs/fuse/connections first if
// it is not there): every waiting and future request fails with ENOTCONN instead of hanging.
// NOT_FOUND if no such connection exists (already gone).
absl::Status AbortFuseConnectionBlocking(uint32_t dev_minor);

}  // namespace fusekeeper
