// Timer: a Loop timer owned like a member (as Envoy's TimerPtr): armed again, the earlier
// deadline is dropped; destroyed, it never fires. Replaces TimerId bookkeeping and hand-written
// CancelTimer calls. Timers: a set of one-shot timers owned together.
//
// Threading: the loop's thread (or the creating thread before Run, or after Run has returned).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>

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

// Timers: one-shot timers owned together (an object's retries and graces, as many as it has
// waiting): each is gone once it has fired; none fires once the set is destroyed or cleared.
class Timers {
 public:
  explicit Timers(Loop& loop) : loop_(loop) {}
  ~Timers() { CancelAll(); }
  Timers(const Timers&) = delete;
  Timers& operator=(const Timers&) = delete;

  // Runs `fn` once after `delay`. `fn` may add timers, or destroy this set.
  void Add(std::chrono::nanoseconds delay, absl::AnyInvocable<void()> fn) {
    const uint64_t key = next_key_++;
    const TimerId id = loop_.AddTimer(delay, [this, key] {
      auto it = pending_.find(key);
      if (it == pending_.end()) return;
      absl::AnyInvocable<void()> fn = std::move(it->second.fn);
      pending_.erase(it);
      fn();  // last: it may destroy this set
    });
    pending_.emplace(key, Pending{id, std::move(fn)});
  }
  void CancelAll() {
    for (auto& [key, p] : pending_) loop_.CancelTimer(p.id);
    pending_.clear();
  }
  size_t size() const { return pending_.size(); }

 private:
  struct Pending {
    TimerId id;
    absl::AnyInvocable<void()> fn;
  };
  Loop& loop_;
  uint64_t next_key_ = 0;
  std::map<uint64_t, Pending> pending_;
};

}  // namespace fusekeeper
