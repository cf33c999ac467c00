// RepairScheduler: the fuse kind's repair bookkeeping, apart from what a repair does. It knows
// which volumes have a repair running (a second trigger for such a volume is dropped: the running
// one covers it) and runs a repair that could not start (an RPC held the volume) or failed again
// after a backoff of its volume's own, which doubles from `first` up to `max` and starts over
// once a repair of that volume succeeds. The retries are timers it owns: destroyed, none runs.
//
// Loop thread only; no I/O (tests/volume/repair_scheduler_test.cc runs it on the test's thread).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/time/time.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

class RepairScheduler {
 public:
  RepairScheduler(Loop& loop, absl::Duration first, absl::Duration max) : loop_(loop), first_(first), max_(max) {}
  RepairScheduler(const RepairScheduler&) = delete;
  RepairScheduler& operator=(const RepairScheduler&) = delete;

  bool running(const std::string& volume_id) const { return running_.count(volume_id) > 0; }
  // A repair of the volume has started.
  void Began(const std::string& volume_id) { running_.insert(volume_id); }
  // It succeeded: the volume's backoff starts over.
  void Succeeded(const std::string& volume_id);
  // It failed (a retry is the caller's to ask for, with RetryLater).
  void Failed(const std::string& volume_id) { running_.erase(volume_id); }
  // Runs `retry` after the volume's next backoff, which it returns.
  absl::Duration RetryLater(const std::string& volume_id, absl::AnyInvocable<void()> retry);
  // Retries waiting to run (for tests and stats).
  size_t retries_pending() const { return retries_.size(); }

 private:
  Loop& loop_;
  const absl::Duration first_;
  const absl::Duration max_;
  std::set<std::string> running_;
  std::map<std::string, absl::Duration> backoff_;  // the last one each volume waited
  std::map<uint64_t, std::unique_ptr<Timer>> retries_;
  uint64_t next_retry_ = 0;
};

}  // namespace fusekeeper
