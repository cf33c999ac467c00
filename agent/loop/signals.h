// SignalWatcher: delivers SIGTERM/SIGINT (or any set) as callbacks on the loop thread from a
// signalfd polled on the loop (either backend). Call BlockSignalsInThisProcess() in main() before any thread starts
// so that no thread takes the signal the classic way.
#pragma once

#include <signal.h>
#include <sys/signalfd.h>

#include <initializer_list>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"
#include "agent/loop/loop.h"
#include "agent/loop/poll_watch.h"

namespace fusekeeper {

// Blocks signals in the calling thread; threads created afterwards inherit the mask.
void BlockSignals(std::initializer_list<int> signals);
// Unblocks them in the calling thread (their handlers, or default actions, apply again).
void UnblockSignals(std::initializer_list<int> signals);

class SignalWatcher {
 public:
  // Loop thread (or before Run). The signals must already be blocked. on_signal runs on the loop
  // thread with the signal number, for every delivery, until the loop stops.
  static absl::StatusOr<std::unique_ptr<SignalWatcher>> Create(
      Loop& loop, std::initializer_list<int> signals, absl::AnyInvocable<void(int signo)> on_signal);
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;
  // Loop thread (or after the loop's Run has returned).
  ~SignalWatcher() = default;

 private:
  SignalWatcher(Loop& loop, UniqueFd fd, absl::AnyInvocable<void(int)> on_signal);
  void Watch();

  Loop& loop_;
  UniqueFd fd_;
  absl::AnyInvocable<void(int)> on_signal_;
  std::unique_ptr<PollWatch> watch_;
};

}  // namespace fusekeeper
