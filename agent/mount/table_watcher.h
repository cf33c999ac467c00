// MountTableWatcher: tells the loop when this mount namespace's mount table has changed. A
// multishot POLL_ADD(POLLPRI) on /proc/self/mountinfo through the ring (the kernel reports
// POLLPRI|POLLERR once per change seen by this open file), so nothing waits on the loop thread
// and nothing is polled on a timer. Bursts of changes are coalesced: `on_change` is not called
// again until the previous call's `done` has run, and then at most once more for everything
// that happened meanwhile.
#pragma once

#include <memory>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"
#include "agent/loop/lifetime.h"
#include "agent/loop/loop.h"

namespace fusekeeper {

class MountTableWatcher {
 public:
  using Done = absl::AnyInvocable<void()>;
  // Loop thread; `done` must be called (on the loop thread) when the change has been handled.
  using OnChange = absl::AnyInvocable<void(Done done)>;

  // Opens the file; the watch starts at once. `path` is for tests.
  static absl::StatusOr<std::unique_ptr<MountTableWatcher>> Start(
      Loop& loop, OnChange on_change, const std::string& path = "/proc/self/mountinfo");
  // Like MountTableReader, must outlive the loop's run: destroy after the loop has stopped.
  ~MountTableWatcher();

  uint64_t changes_seen() const { return changes_seen_; }

 private:
  MountTableWatcher(Loop& loop, UniqueFd fd, OnChange on_change);
  void Arm();
  void Fire();

  Loop& loop_;
  UniqueFd fd_;
  OnChange on_change_;
  Completion poll_;
  bool armed_ = false;
  bool handling_ = false;
  bool dirty_ = false;
  uint64_t changes_seen_ = 0;
  // Outlives the watcher for callbacks that complete after it is gone.
  Aliveness alive_;
};

}  // namespace fusekeeper
