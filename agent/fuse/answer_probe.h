// AnswerProbe: asks a FUSE mount's server one question it must answer, without the loop ever
// waiting for it. A statx of the mount's root with AT_STATX_FORCE_SYNC (a GETATTR the kernel may
// not answer from its cache) issued on the loop's ring: io_uring always runs STATX in a kernel
// io-wq worker, so the loop thread never blocks. Until the server has answered FUSE_INIT the
// kernel holds the request in fuse_get_req (a killable wait, which no io_uring cancel ends); an
// abort of the connection (fusectl) ends it with ENOTCONN, an answer with 0.
//
// This is the one place the agent deliberately makes a FUSE server answer (elsewhere it reads
// the mount table or statmount, or uses statx with AT_STATX_DONT_SYNC). Its owner bounds it
// (FuseKind: --init_timeout_ms, after which the connection is aborted, which also frees the
// worker). A probe still pending when the loop stops is abandoned by the loop after its stop
// bound (loop.h).
//
// Threading: loop thread only. Ownership: a probe owns itself until the kernel has completed
// it (its Completion and statx buffer must stay where they are until then); the handle Start
// returns only observes it, and Abandon() silences it.
#pragma once

#include <memory>
#include <string>

#include "absl/functional/any_invocable.h"
#include "agent/loop/loop.h"

namespace fusekeeper {

class AnswerProbe {
 public:
  // The statx's result: 0 (the server answered), or -errno (ENOTCONN: the connection was
  // aborted; ECANCELED: the loop is stopping).
  using Done = absl::AnyInvocable<void(int32_t res)>;

  // Loop thread. Starts the probe of `path` (the mount's root); `done` runs once, on the loop
  // thread, when it completes, unless Abandon() was called first.
  static std::shared_ptr<AnswerProbe> Start(Loop& loop, std::string path, Done done);

  // Loop thread. `done` will not run; the probe lives on until the kernel completes it.
  void Abandon() { done_ = nullptr; }
  bool pending() const { return pending_; }
  const std::string& path() const { return path_; }

 private:
  explicit AnswerProbe(Loop& loop, std::string path, Done done)
      : loop_(loop), path_(std::move(path)), done_(std::move(done)) {}

  Loop& loop_;
  const std::string path_;
  Done done_;
  struct statx stx_ {};
  Completion completion_;
  std::shared_ptr<AnswerProbe> self_;  // until the kernel has completed the statx
  bool pending_ = true;
};

}  // namespace fusekeeper
