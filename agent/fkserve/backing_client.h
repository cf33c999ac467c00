// BackingClient: a FUSE server's side of passthrough brokered by the agent (handoff_protocol.h,
// agent/fuse/backing_broker.h). The server opens a file itself and asks the agent, over its
// handoff connection, to register it as a backing file of the connection; the answer is a
// backing id for its OPEN/CREATE reply (FOPEN_PASSTHROUGH), or a refusal, after which that open
// is served the ordinary way. A refusal that will not change (the agent brokers none, or the
// connection did not negotiate passthrough) turns the client off.
//
// Threading: Open and Close from the file system's threads; SetSocket and Deliver from the
// server's loop (AgentLink), which owns the connection and reads the answers.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"
#include "agent/fuse/handoff_protocol.h"

namespace fusekeeper {

class BackingClient {
 public:
  // The connection to the agent (a dup), or none: requests then fail at once, and so do the ones
  // waiting (their answers would have come on the connection that ended).
  void SetSocket(UniqueFd sock);
  // Blocking, bounded by `timeout`: the backing id of `fd`. The FUSE session waits meanwhile, so
  // after an answer that did not come in time the client asks nothing for `pause` (opens are
  // served the ordinary way): a hung agent costs the volume one wait, not one per open.
  absl::StatusOr<int32_t> Open(int fd, std::chrono::milliseconds timeout = std::chrono::seconds(2),
                               std::chrono::milliseconds pause = std::chrono::seconds(10));
  // Unregisters `backing_id`; its answer is not waited for.
  void Close(int32_t backing_id);
  // An answer from the agent (AgentLink).
  void Deliver(const BackingReply& reply);
  bool enabled() const;
  int64_t opened() const;

 private:
  void CloseLocked(int32_t backing_id);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  UniqueFd sock_;
  uint64_t next_id_ = 0;
  std::map<uint64_t, std::optional<BackingReply>> waiting_;  // opens waiting for their answer
  std::set<uint64_t> abandoned_;  // opens that stopped waiting (timed out)
  bool enabled_ = true;
  std::chrono::steady_clock::time_point paused_until_{};
  int64_t opened_ = 0;
};

}  // namespace fusekeeper
