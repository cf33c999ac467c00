// BackingBroker: FUSE passthrough for unprivileged servers (issue 30). A server that opened a
// file itself asks the agent, over its handoff connection (handoff_protocol.h), to register it
// as a backing file of its connection; the agent checks it (a regular file, not O_PATH, one the
// server's user may open with that access mode) and calls FUSE_DEV_IOC_BACKING_OPEN on its own
// copy of the connection. The kernel records the caller's credentials and opens and does the
// backing file's I/O with them (fs/fuse/passthrough.c, fb->cred), so the call is never made as
// the agent's root: each server identity (uid, gid and supplementary groups, as the kernel reports
// the server's socket peer) gets a thread of its own that switched, for good, to that identity
// with CAP_SYS_ADMIN as its only capability (raw syscalls: glibc's set*id would change every
// thread of the agent).
//
// Threading: Open and Close on the loop thread; `done` runs there too. The ioctls run on the
// identity threads, on a dup of the connection fd made at the call (the caller may close its own).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"
#include "agent/loop/loop.h"

namespace fusekeeper {

struct ServerIdentity {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary
  bool operator<(const ServerIdentity& o) const {
    return std::tie(uid, gid, groups) < std::tie(o.uid, o.gid, o.groups);
  }
};

// The credentials of the process at the other end of a Unix socket (SO_PEERCRED, SO_PEERGROUPS).
absl::StatusOr<ServerIdentity> PeerIdentity(int sock);

// Whether `fd` may become a backing file: a regular file, opened for reading or writing (not
// O_PATH). The refusal says which. (Whether the server's user may open it is checked on its
// identity thread, by opening it again there.)
absl::Status CheckBackingFile(int fd);

class BackingBroker {
 public:
  explicit BackingBroker(Loop& loop);
  ~BackingBroker();  // stops and joins the identity threads (their pending calls are dropped)
  BackingBroker(const BackingBroker&) = delete;
  BackingBroker& operator=(const BackingBroker&) = delete;

  // Registers `file` as a backing file of connection `conn` as `who`: the backing id, or why not
  // (CheckBackingFile's refusal, or the kernel's: EPERM when the connection did not negotiate
  // passthrough, ELOOP when the file is itself on a stacked file system).
  void Open(int conn, UniqueFd file, const ServerIdentity& who, absl::AnyInvocable<void(absl::StatusOr<int32_t>)> done);
  // Unregisters backing id `id` (open files that use it keep their own reference); `done` may be
  // null.
  void Close(int conn, int32_t id, const ServerIdentity& who, absl::AnyInvocable<void(absl::Status)> done = nullptr);

  // Since start, on the loop thread: files registered, registrations refused (checks or the
  // kernel), and ids closed.
  struct Stats {
    int64_t registered = 0, refused = 0, closed = 0;
  };
  const Stats& stats() const { return *stats_; }

 private:
  class Worker;
  Worker& WorkerFor(const ServerIdentity& who);

  Loop& loop_;
  // (Before the workers, which use it until they are joined; posted callbacks may outlive both.)
  std::shared_ptr<Stats> stats_ = std::make_shared<Stats>();
  std::map<ServerIdentity, std::unique_ptr<Worker>> workers_;
};

}  // namespace fusekeeper
