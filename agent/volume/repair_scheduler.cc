#include "agent/volume/repair_scheduler.h"

#include <algorithm>
#include <utility>

namespace fusekeeper {

void RepairScheduler::Succeeded(const std::string& volume_id) {
  running_.erase(volume_id);
  backoff_.erase(volume_id);
}

absl::Duration RepairScheduler::RetryLater(const std::string& volume_id, absl::AnyInvocable<void()> retry) {
  absl::Duration& d = backoff_[volume_id];
  d = d == absl::ZeroDuration() ? first_ : std::min(d * 2, max_);
  const uint64_t n = ++next_retry_;
  auto& timer = retries_[n] = std::make_unique<Timer>(loop_);
  timer->Arm(absl::ToChronoNanoseconds(d), [this, n, retry = std::move(retry)]() mutable {
    auto run = std::move(retry);
    retries_.erase(n);  // the timer that called us: it touches nothing of its own after
    run();
  });
  return d;
}

}  // namespace fusekeeper
