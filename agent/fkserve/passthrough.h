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
#include "absl/status/statusor.h"

namespace fusekeeper {

class BackingClient;
class BackingTable;

struct PassthroughOptions {
  std::string root;                     // the directory to export
  bool read_only = false;
  std::optional<uint32_t> mount_group;  // present files with this gid
  // The connection's FUSE_INIT request, as read from /dev/fuse. It is fed to libfuse first
  // (the kernel sends INIT once per connection, and libfuse serves nothing before it).
  std::string init_request;
  // The connection was served before (adoption after a restart): the INIT was answered already,
  // so libfuse's answer is dropped, and the kernel is asked to resend the requests the dead
  // server had read but not answered (FUSE_NOTIFY_RESEND, Linux 6.9+).
  bool live = false;
  // Readable: serving ends, as after an unmount (the owner's loop takes the stop signals). -1:
  // libfuse's own handlers of SIGTERM, SIGINT and SIGHUP end it.
  int stop_fd = -1;
  // FUSE passthrough brokered by the agent (backing_client.h): offered in the INIT reply where
  // the kernel offers it, then every OPEN and CREATE asks the agent for a backing id and, given
  // one, the kernel reads, writes and maps the file itself. Null: no passthrough.
  BackingClient* backing = nullptr;
  // With `backing`: which open handles pass through to which backing id (backing_table.h),
  // shared with the connection's earlier and later servers. Null: no passthrough.
  BackingTable* backing_table = nullptr;
  // False (passthrough turned off on a connection that had it): opens of files still open in
  // passthrough share their backing file (the kernel allows no other way), and every other open is
  // served the ordinary way; no file is registered.
  bool register_backing = true;
  // Extended attributes of the export. Off: every xattr operation answers ENOSYS, which the
  // kernel remembers and then never asks again; that spares each passthrough write the GETXATTR
  // of security.capability the kernel makes before it (file_remove_privs) — 0.84–0.89 of native
  // write speed with them, 0.97–0.98 without (bench/passthrough_bench.cc).
  bool xattrs = true;
};

// Blocking. Reads the FUSE_INIT request a fresh connection starts with (waiting up to
// `timeout_ms` for it). Errors name what was wrong (not INIT, connection aborted, timeout).
absl::StatusOr<std::string> ReadInitRequest(int fuse_fd, int timeout_ms);

// Serves the FUSE connection `fuse_fd` (already mounted by the agent) until it ends (unmount or
// abort). Blocks. Takes ownership of fuse_fd. Node ids are stable across restarts (see
// passthrough.cc), so a successor can adopt the live connection.
absl::Status ServePassthrough(int fuse_fd, const PassthroughOptions& options);

}  // namespace fusekeeper
