// HandoffEndpoint's private structures, shared by its source files (handoff_endpoint*.cc). Not
// for other users.
#pragma once

#include <optional>
#include <set>

#include <sys/socket.h>
#include <sys/types.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "agent/loop/lifetime.h"
#include "agent/loop/timer.h"
#include "agent/fuse/backing_broker.h"
#include "agent/base/fd_passing.h"
#include "agent/base/unique_fd.h"
#include "agent/fuse/handoff_endpoint.h"
#include "agent/fuse/handoff_io.h"
#include "agent/loop/loop.h"

namespace fusekeeper {

// One server's connection: its socket (the ring adapter's) and where the endpoint stands with it.
struct HandoffEndpoint::Connection {
  Connection(Loop& loop, PendingWork& work, UniqueFd fd) : peer(loop, work, std::move(fd), kMaxHandoffMessageBytes) {}
  HandoffPeer peer;
  pid_t peer_pid = 0;  // 0: the peer is in another pid namespace (a pod without hostPID)
  uid_t peer_uid = 0;
  // Who the peer is, for logs: its pid when this namespace can see it, its uid always.
  std::string Peer() const {
    return peer_pid > 0 ? absl::StrCat("server pid ", peer_pid, " (uid ", peer_uid, ")")
                        : absl::StrCat("server uid ", peer_uid, " (pid not visible: another pid namespace)");
  }
  bool live = false;  // the offer was of a connection an earlier server initialised
  bool refused = false;
  std::string tag;  // the listener it came through (AddListener); empty: the main one
  bool draining = false;  // serving, asked to stop, waiting for a successor (MountConfig::drain_ms)
  bool relieved = false;  // told to stop
  // Passthrough (handoff_backing.cc): who the server is, its requests in flight; `alive` guards
  // the broker's answers, which may come after the connection ended.
  std::optional<ServerIdentity> identity;
  int backing_in_flight = 0;
  int64_t backing_opened = 0;
  bool backing_refusal_reported = false;
  Aliveness alive;
};

}  // namespace fusekeeper
