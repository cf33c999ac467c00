// What a listener on the ring does when accept fails for want of resources (EMFILE, ENFILE,
// ENOBUFS, ENOMEM): the connection stays queued on the socket, so accepting again at once fails at
// once again, a hot loop that writes a log line per failure. Instead the next accept waits, 50 ms
// doubling to 2 s while it keeps failing, through a ring timeout armed on the accept's own
// Completion (closing the listener cancels it as it would the accept). Logged once when the
// pause starts and once when accepts succeed again.
#pragma once

#include <errno.h>
#include <liburing.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "agent/loop/loop.h"
#include "glog/logging.h"

namespace fusekeeper {

class AcceptBackoff {
 public:
  // Whether accept's result `res` (-errno) is a want of resources that a pause may cure.
  static bool OutOfResources(int32_t res) {
    return res == -EMFILE || res == -ENFILE || res == -ENOBUFS || res == -ENOMEM;
  }

  // After a failed accept (OutOfResources): arms the pause on `c`. The Completion's callback
  // then runs with -ETIME (or -ECANCELED if closed); `paused()` says so until Resumed or Ended.
  void Pause(Loop& loop, Completion* c, const std::string& what, int32_t res) {
    ++pauses_;
    delay_ = delay_.count() == 0 ? kFirst : std::min(delay_ * 2, kMax);
    if (!logged_) {
      LOG(WARNING) << what << ": accept failed (" << std::strerror(-res) << "); waiting " << delay_.count()
                   << " ms before the next one (up to " << kMax.count() << " ms while it keeps failing)";
      logged_ = true;
    }
    ts_.tv_sec = delay_.count() / 1000;
    ts_.tv_nsec = (delay_.count() % 1000) * 1000000;
    paused_ = true;
    io_uring_sqe* sqe = loop.GetSqe();
    io_uring_prep_timeout(sqe, &ts_, 0, 0);
    loop.Arm(sqe, c);
  }
  // The pause's completion came back.
  void Ended() { paused_ = false; }
  // An accept succeeded: the next failure starts from the first delay again.
  void Resumed(const std::string& what) {
    if (logged_) LOG(INFO) << what << ": accepting again";
    logged_ = false;
    pauses_ = 0;
    delay_ = std::chrono::milliseconds(0);
  }
  bool paused() const { return paused_; }
  // Pauses since the last accept that worked, and the current (or last) one's length.
  int pauses() const { return pauses_; }
  std::chrono::milliseconds delay() const { return delay_; }

 private:
  static constexpr std::chrono::milliseconds kFirst{50}, kMax{2000};
  std::chrono::milliseconds delay_{0};
  __kernel_timespec ts_{};  // read by the kernel until the timeout completes
  int pauses_ = 0;
  bool paused_ = false, logged_ = false;
};

}  // namespace fusekeeper
