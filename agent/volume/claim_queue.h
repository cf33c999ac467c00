// ClaimQueue: which operation may work on a volume now, and who waits for it (FIFO, bounded).
//
// Threading: loop thread only (the queue posts grants and arms timers on its Loop).
//
// A claim is on the whole volume (target "": stage, unstage, inline volumes, repairs) or on one
// target of it (a publish or unpublish of a staged volume). A whole claim excludes every other
// claim on the volume; target claims exclude the whole claim and the same target only.
//
// One way in, one way out: a claim is a move-only Claim handle, and the claim ends exactly when
// that handle is released or destroyed. Nothing else ends it, and nothing can forget to: an
// operation that is refused after its turn came drops its handle like any other, and the next
// waiters start. (Issue 18: a refused waiter that held no handle never passed the turn on, and
// its volume wedged for max_wait.)
//
// Invariant (checked by tests/volume/claim_queue_test.cc): whenever a volume has waiters, the
// first of them conflicts with a claim that is held; so a queue never stands still while nothing
// runs on its volume.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

class ClaimQueue {
 private:
  struct State;

 public:
  struct Options {
    // More waiters than this per volume: RESOURCE_EXHAUSTED.
    int max_queued_per_volume = 256;
    // A waiter not granted by then: ABORTED naming the volume.
    absl::Duration max_wait = absl::Seconds(60);
  };

  // The claim, while this handle holds it. Move-only; loop thread only. Releasing twice, or
  // after the queue is gone, does nothing.
  class Claim {
   public:
    Claim() = default;
    Claim(Claim&& other) noexcept { *this = std::move(other); }
    Claim& operator=(Claim&& other) noexcept;
    Claim(const Claim&) = delete;
    Claim& operator=(const Claim&) = delete;
    ~Claim() { Release(); }

    explicit operator bool() const { return held_; }
    const std::string& volume_id() const { return volume_id_; }
    const std::string& target() const { return target_; }
    // Ends the claim; the waiters at the front whose claims are now free are granted theirs.
    void Release();

   private:
    friend class ClaimQueue;
    std::weak_ptr<State> state_;
    std::string volume_id_, target_;
    bool held_ = false;
  };

  using Granted = absl::AnyInvocable<void(Claim)>;
  using Refused = absl::AnyInvocable<void(absl::Status)>;

  ClaimQueue(Loop& loop, Options options);
  // Waiters still queued are dropped unanswered (the loop is stopping); outstanding Claims
  // become no-ops.
  ~ClaimQueue();
  ClaimQueue(const ClaimQueue&) = delete;
  ClaimQueue& operator=(const ClaimQueue&) = delete;

  // The claim now if it is free and no waiter that wants a conflicting claim is ahead; an empty
  // Claim otherwise. For work that tries again later instead of waiting (repairs).
  Claim TryAcquire(const std::string& volume_id, const std::string& target);

  // `granted` runs at once (inline) if TryAcquire would succeed. Otherwise the request waits its
  // turn: when it comes, the claim is taken for it and `granted` runs from a loop post (after the
  // callback that released the claim before). `refused` runs instead if the queue is full
  // (RESOURCE_EXHAUSTED) or the turn does not come within max_wait (ABORTED).
  void Acquire(const std::string& volume_id, const std::string& target, Granted granted, Refused refused);

  // Any claim on the volume is held.
  bool Busy(const std::string& volume_id) const;
  // How many wait for the volume.
  size_t waiting(const std::string& volume_id) const;

 private:
  struct Waiter {
    explicit Waiter(Loop& loop) : timer(loop) {}
    std::string target;
    Granted granted;
    Refused refused;
    Timer timer;  // the turn's max wait
    absl::Time since;
  };
  struct Claims {
    bool whole = false;
    std::set<std::string> targets;
  };
  struct State {
    Loop* loop;
    Options options;
    std::map<std::string, Claims> held;  // volumes with any claim
    std::map<std::string, std::deque<std::shared_ptr<Waiter>>> waiters;  // per volume, FIFO

    bool Free(const std::string& volume_id, const std::string& target) const;
    bool ConflictWaits(const std::string& volume_id, const std::string& target) const;
    Claim Take(const std::shared_ptr<State>& self, const std::string& volume_id, const std::string& target);
    void Release(const std::shared_ptr<State>& self, const std::string& volume_id, const std::string& target);
    // Grants the waiters at the front of the volume's queue whose claims are free, in order; the
    // first that must still wait keeps its place, and so do those behind it.
    void GrantWaiting(const std::shared_ptr<State>& self, const std::string& volume_id);
  };
  std::shared_ptr<State> state_;
};

}  // namespace fusekeeper
