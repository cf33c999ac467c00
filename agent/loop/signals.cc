#include "agent/loop/signals.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fusekeeper {

void BlockSignals(std::initializer_list<int> signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals) sigaddset(&set, s);
  int r = pthread_sigmask(SIG_BLOCK, &set, nullptr);
  CHECK_EQ(r, 0) << "pthread_sigmask: " << std::strerror(r);
}

void UnblockSignals(std::initializer_list<int> signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals) sigaddset(&set, s);
  int r = pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  CHECK_EQ(r, 0) << "pthread_sigmask: " << std::strerror(r);
}

absl::StatusOr<std::unique_ptr<SignalWatcher>> SignalWatcher::Create(
    Loop& loop, std::initializer_list<int> signals, absl::AnyInvocable<void(int)> on_signal) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals) sigaddset(&set, s);
  int fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (fd < 0) return absl::InternalError(absl::StrCat("signalfd: ", std::strerror(errno)));
  std::unique_ptr<SignalWatcher> w(new SignalWatcher(loop, UniqueFd(fd), std::move(on_signal)));
  w->Watch();
  return w;
}

SignalWatcher::SignalWatcher(Loop& loop, UniqueFd fd, absl::AnyInvocable<void(int)> on_signal)
    : loop_(loop), fd_(std::move(fd)), on_signal_(std::move(on_signal)) {}

// A poll, not a read: the epoll backend (no io_uring) has no reads, and a read of a signalfd on
// the ring could sleep inline in the loop thread.
void SignalWatcher::Watch() {
  watch_ = std::make_unique<PollWatch>(loop_, fd_.get(), POLLIN, /*multishot=*/true, [this](int res) {
    if (res < 0) {
      LOG(ERROR) << "polling signalfd: " << std::strerror(-res);
      return;
    }
    signalfd_siginfo info{};
    while (read(fd_.get(), &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
      on_signal_(static_cast<int>(info.ssi_signo));
    }
  });
}

}  // namespace fusekeeper
