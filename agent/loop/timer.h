// Timer: a Loop timer owned like a member (as Envoy's TimerPtr): armed again, the earlier
// deadline is dropped; destroyed, it never fires. Replaces TimerId bookkeeping and hand-written
// CancelTimer calls.
//
// Threading: the loop's thread (or the creating thread before Run, or after Run has returned).
#pragma once

#include <chrono>

#include "absl/functional/any_invocable.h"
#include "agent/loop/loop.h"

namespace fusekeeper {

class Timer {
 public:
  explicit Timer(Loop& loop) : loop_(loop) {}
  ~Timer() { Cancel(); }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  // Runs `fn` after `delay` (once); an earlier deadline of this timer is dropped. `fn` may arm
  // the timer again, or destroy it.
  void Arm(std::chrono::nanoseconds delay, absl::AnyInvocable<void()> fn) {
    Cancel();
    fn_ = std::move(fn);
    id_ = loop_.AddTimer(delay, [this] {
      id_ = 0;
      absl::AnyInvocable<void()> fn = std::move(fn_);
      fn();  // last: it may destroy this timer
    });
  }
  void Cancel() {
    if (id_ == 0) return;
    loop_.CancelTimer(id_);
    id_ = 0;
    fn_ = nullptr;
  }
  bool armed() const { return id_ != 0; }

 private:
  Loop& loop_;
  TimerId id_ = 0;
  absl::AnyInvocable<void()> fn_;
};

}  // namespace fusekeeper
