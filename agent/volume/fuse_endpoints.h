// FuseEndpoints: the fuse kind's registry of handoff endpoints, one per FUSE mount (a staged
// volume's global mount, an inline volume's target), by volume and mount path, with what the
// kind keeps beside each: its deadlines (owned Timers: a removed entry's never fire), the probe
// that asks whether a new server answers, and what a recovery in progress waits for. It decides
// nothing; FuseKind does (fuse_kind_endpoints.cc, fuse_kind_recovery.cc).
//
// Loop thread only.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "agent/fuse/answer_probe.h"
#include "agent/fuse/handoff_endpoint.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

struct FuseEndpoint {
  explicit FuseEndpoint(Loop& loop) : handoff_deadline(loop), init_deadline(loop), tune_retry(loop) {}

  // Forgets the server-answer probe and its deadline (the probe itself lives until the kernel
  // completes it, harmlessly).
  void StopAnswerProbe();

  HandoffEndpoint::Ptr endpoint;
  uint64_t serial = 0;  // tells this entry from a later one for the same mount
  // No server served it within the handoff timeout (OnHandoffTimeout).
  Timer handoff_deadline;
  bool gave_up = false;     // that deadline (or the init one) passed: the connection was aborted
  int gone_pending = 0;     // server-gone Warnings waiting out server_gone_grace
  std::string gone_reason;  // why its server stopped serving, once it has
  int adoptions_seen = 0;
  bool relayed = false;  // its server said it relays (HandoffReply::relayed)
  absl::Time recovering_since = absl::InfinitePast();  // a recovery awaits a serving server
  std::string recovering_how;
  // A server took a fresh connection: whether it answers (FUSE_INIT, then a GETATTR) is asked
  // until init_deadline; `answer_server` names that server.
  std::shared_ptr<AnswerProbe> answer_probe;
  Timer init_deadline;
  std::string answer_server;
  Timer tune_retry;  // the tuning waits for an RPC on the volume
  // The device of the directory its handoff socket was made in (fuse_volume_ops.h HandoffSocket).
  uint32_t socket_dir_major = 0, socket_dir_minor = 0;
};

class FuseEndpoints {
 public:
  explicit FuseEndpoints(Loop& loop) : loop_(loop) {}

  // The entry of the mount at `path` of the volume; null if none.
  FuseEndpoint* Find(const std::string& volume_id, const std::string& path);
  const FuseEndpoint* Find(const std::string& volume_id, const std::string& path) const;
  // The same, only if it is still the entry numbered `serial` (not a later one for that mount).
  FuseEndpoint* Find(const std::string& volume_id, const std::string& path, uint64_t serial);
  // A new, numbered entry for the mount; an earlier one must have been taken out first.
  FuseEndpoint& Add(const std::string& volume_id, const std::string& path);
  // Takes the entry out (its deadlines go with it); null if none.
  std::unique_ptr<FuseEndpoint> Take(const std::string& volume_id, const std::string& path);

 private:
  static std::string Key(const std::string& volume_id, const std::string& path);

  Loop& loop_;
  std::map<std::string, std::unique_ptr<FuseEndpoint>> entries_;
  uint64_t serial_ = 0;
};

}  // namespace fusekeeper
