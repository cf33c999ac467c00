// PollWatch: a poll of one fd on a Loop, owned like any member, however long the loop takes to
// be done with it.
//
// The Loop's rule is that a Completion outlives its last callback; an owner that goes away (a
// closed connection, an instance that ended) while its poll is in flight cannot keep that rule by
// itself. A PollWatch keeps it for the owner: destroying it cancels the poll and hands its
// completion to the loop, which frees it after its last callback; `fn` never runs again. Works on
// both of the Loop's backends (the ring's POLL_ADD and epoll).
//
// Threading: the loop thread (or the creating thread before Run, or any thread after Run has
// returned).
#pragma once

#include "absl/functional/any_invocable.h"
#include "agent/loop/loop.h"

namespace fusekeeper {

class PollWatch {
 public:
  // `fn(res)`: the poll's revents (> 0), or -errno when the poll itself failed (then it is over).
  // Multishot: every time there is news (drain the fd: the epoll backend is edge-triggered), and
  // armed again by itself if the kernel ends it early; single-shot: once.
  using Fn = absl::AnyInvocable<void(int res)>;
  PollWatch(Loop& loop, int fd, unsigned mask, bool multishot, Fn fn);
  ~PollWatch();
  PollWatch(const PollWatch&) = delete;
  PollWatch& operator=(const PollWatch&) = delete;
  // The poll is in flight (a single-shot one that fired, or one that failed, is not).
  bool active() const;

 private:
  struct Op;
  Op* op_;
};

}  // namespace fusekeeper
