// The two lifetime idioms of code on the loop (as Envoy's deferred delete and its weak guards),
// used instead of ad-hoc self-references and shared flags:
//
// - DeleteLater(loop, x): `x` (a unique_ptr, a shared_ptr, or a struct of them) is destroyed
//   once the current callback has returned, never from inside it: an object whose own callback
//   is running (a completion it owns, a timer it holds) is handed here instead of destroyed.
// - Aliveness: an owner whose callbacks may be called after it is gone (work finished on a
//   pool, a callback handed to another object) holds one as a member; each such callback
//   captures token() and returns at once when !token.alive(). Checked on the owner's thread.
//
// Threading: the loop's thread (DeleteLater: any thread, as Loop::Post).
#pragma once

#include <memory>
#include <utility>

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

}  // namespace fusekeeper
