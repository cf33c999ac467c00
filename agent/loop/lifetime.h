// The two lifetime idioms of code on the loop (as Envoy's deferred delete and its weak guards),
// used instead of ad-hoc self-references and shared flags:
//
// - DeleteLater(loop, x): `x` (a unique_ptr, a shared_ptr, or a struct of them) is destroyed
//   once the current callback has returned, never from inside it: an object whose own callback
//   is running (a completion it owns, a timer it holds) is handed here instead of destroyed.
// - Aliveness: an owner whose callbacks may be called after it is gone (work finished on a
//   pool, a callback handed to another object) holds one as a member; each such callback
//   captures token() and returns at once when !token.alive(). Checked on the owner's thread.
// - PendingWork: an owner of ring operations and of answers it waits for (the handoff endpoint)
//   counts them in one, and is retired instead of destroyed: once nothing it began is pending,
//   it is destroyed from a posted callback. Every ring callback ends its work last (an Ended
//   guard); an answer another object owes holds a Hold, which ends the work when the answer is
//   destroyed, run or not.
//
// Threading: the loop's thread (DeleteLater: any thread, as Loop::Post; a Hold may be destroyed
// on any thread).
#pragma once

#include <memory>
#include <utility>

#include "absl/functional/any_invocable.h"

#include "agent/loop/loop.h"

namespace fusekeeper {

template <typename T>
void DeleteLater(Loop& loop, T doomed) {
  auto* held = new T(std::move(doomed));
  // Once the loop has finished (the process is ending) it is left as it is: destroyed here it
  // could be from inside its own callback.
  loop.Post([held] { delete held; });
}

class Aliveness {
 public:
  class Token {
   public:
    bool alive() const { return !owner_.expired(); }

   private:
    friend class Aliveness;
    explicit Token(std::weak_ptr<const int> owner) : owner_(std::move(owner)) {}
    std::weak_ptr<const int> owner_;
  };

  Aliveness() = default;
  Aliveness(const Aliveness&) = delete;
  Aliveness& operator=(const Aliveness&) = delete;

  Token token() const { return Token(owner_); }
  // Ends it before the owner's members are destroyed: an owner whose destructor does work (a
  // cancel, an unregister) calls this first.
  void End() { owner_.reset(); }

 private:
  std::shared_ptr<const int> owner_ = std::make_shared<const int>(0);
};

class PendingWork {
 public:
  explicit PendingWork(Loop& loop) : loop_(loop) {}
  PendingWork(const PendingWork&) = delete;
  PendingWork& operator=(const PendingWork&) = delete;

  void Began() { ++count_; }
  // Once retired, the owner is destroyed (posted) when this was the last work pending.
  void Ended() {
    if (--count_ == 0 && retired_) Schedule();
  }
  int count() const { return count_; }
  bool retired() const { return retired_; }

  // Ends one piece of work when it goes out of scope (a ring callback's first line).
  class EndedGuard {
   public:
    explicit EndedGuard(PendingWork& work) : work_(work) {}
    ~EndedGuard() { work_.Ended(); }
    EndedGuard(const EndedGuard&) = delete;
    EndedGuard& operator=(const EndedGuard&) = delete;

   private:
    PendingWork& work_;
  };

  // One piece of work begun now and ended when the Hold is destroyed (moved: once). Destroyed off
  // the loop thread, it ends the work on the loop thread (a post), or at once if the loop has
  // finished.
  class Hold {
   public:
    Hold(Hold&& o) noexcept : work_(o.work_) { o.work_ = nullptr; }
    Hold& operator=(Hold&&) = delete;
    Hold(const Hold&) = delete;
    ~Hold() {
      if (work_ == nullptr) return;
      PendingWork* w = work_;
      // (Post refuses only as the loop finishes: then nothing runs on it to race with.)
      if (w->loop_.IsLoopThread() || w->loop_.finished() || !w->loop_.Post([w] { w->Ended(); })) w->Ended();
    }

   private:
    friend class PendingWork;
    explicit Hold(PendingWork* work) : work_(work) { work_->Began(); }
    PendingWork* work_;
  };
  Hold HoldOne() { return Hold(this); }

  // Loop thread (or any, once the loop has finished), once. `destroy` destroys the owner (and
  // this with it) from a posted callback as soon as nothing is pending; once the loop has
  // finished, at once (no callback of the loop can be on the stack then).
  void Retire(absl::AnyInvocable<void()> destroy) {
    retired_ = true;
    destroy_ = std::move(destroy);
    if (count_ == 0) Schedule();
  }

 private:
  void Schedule() {
    if (scheduled_) return;
    scheduled_ = true;
    const bool posted = loop_.Post([this] {
      scheduled_ = false;
      if (count_ == 0) Destroy();  // else the last Ended schedules again
    });
    if (posted) return;
    scheduled_ = false;
    // Refused while the loop's last posts run (a callback may be on the stack): left as it is.
    if (loop_.finished()) Destroy();
  }
  // `destroy` destroys this, and itself with it: it runs from the stack.
  void Destroy() {
    absl::AnyInvocable<void()> destroy = std::move(destroy_);
    destroy();
  }

  Loop& loop_;
  int count_ = 0;
  bool retired_ = false;
  bool scheduled_ = false;
  absl::AnyInvocable<void()> destroy_;
};

}  // namespace fusekeeper
