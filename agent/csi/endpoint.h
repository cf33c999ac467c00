// The CSI endpoint: parsing `unix:///path/csi.sock` and preparing the socket path safely.
// Runs at start-up on the main thread (before the loop); may block briefly on connect().
#pragma once

#include <sys/types.h>
#include <time.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fusekeeper {

// Longest path that fits sockaddr_un.sun_path with its terminating NUL.
inline constexpr size_t kMaxUnixSocketPath = 107;

// Accepts "unix:///abs/path", "unix:/abs/path" and "/abs/path"; returns the absolute path.
// Anything else (tcp://, relative paths, paths longer than kMaxUnixSocketPath, NUL bytes)
// → InvalidArgument naming the problem.
absl::StatusOr<std::string> ParseUnixEndpoint(absl::string_view endpoint);

// Makes `path` free for a new listening socket:
//  - nothing there → OK;
//  - a socket that no one answers on (stale, from a crashed agent) → removed, OK;
//  - a socket someone is listening on → FailedPrecondition ("another process is serving");
//  - a symlink, directory or any other non-socket file → FailedPrecondition, left untouched.
// The parent directory must exist.
absl::Status PrepareSocketPath(const std::string& path);

// Identity of a socket file, to remove it at shutdown only if it is still the one we created.
// Inode numbers are reused quickly (tmpfs), so the change time is part of the identity; record it
// after the last chmod.
struct SocketFileId {
  dev_t dev = 0;
  ino_t ino = 0;
  struct timespec ctime = {};
};
absl::StatusOr<SocketFileId> StatSocketFile(const std::string& path);
// Removes path if it is still the socket identified by id; returns whether it did.
bool RemoveSocketIfOurs(const std::string& path, const SocketFileId& id);

}  // namespace fusekeeper
