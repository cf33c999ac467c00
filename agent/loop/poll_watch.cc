#include "agent/loop/poll_watch.h"

#include <errno.h>

namespace fusekeeper {

// The completion and what it needs, on the heap: freed by the owner when nothing is in flight,
// else by its own last callback once the owner has gone (orphan).
struct PollWatch::Op {
  Loop& loop;
  int fd;
  unsigned mask;
  bool multishot;
  Fn fn;
  Completion c;
  bool armed = false, orphan = false, in_callback = false;

  Op(Loop& l, int f, unsigned m, bool multi, Fn callback)
      : loop(l), fd(f), mask(m), multishot(multi), fn(std::move(callback)) {
    c.callback = [this](int32_t res, bool more) { Completed(res, more); };
  }
  void Arm() {
    armed = true;
    loop.PollAdd(&c, fd, mask, multishot);
  }
  void Completed(int32_t res, bool more) {
    if (!more) armed = false;
    if (!orphan && (res > 0 || (res < 0 && res != -ECANCELED && !more))) {
      in_callback = true;
      fn(res);  // may destroy the owner, and with it orphan this op
      in_callback = false;
    }
    if (orphan) {
      if (armed) {
        loop.Cancel(&c);
      } else {
        delete this;
      }
      return;
    }
    // A multishot poll the kernel ended by itself (not cancelled, not failed) goes on.
    if (multishot && !armed && res >= 0 && !loop.stop_requested()) Arm();
  }
};

PollWatch::PollWatch(Loop& loop, int fd, unsigned mask, bool multishot, Fn fn)
    : op_(new Op(loop, fd, mask, multishot, std::move(fn))) {
  op_->Arm();
}

PollWatch::~PollWatch() {
  op_->orphan = true;
  if (op_->in_callback) return;  // Completed finishes the job once fn has returned
  if (!op_->armed) {
    delete op_;
    return;
  }
  op_->loop.Cancel(&op_->c);
}

bool PollWatch::active() const { return op_->armed; }

}  // namespace fusekeeper
