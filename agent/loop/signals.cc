#include "agent/loop/signals.h"

#include <errno.h>
#include <pthread.h>

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

absl::StatusOr<std::unique_ptr<SignalWatcher>> SignalWatcher::Create(
    Loop& loop, std::initializer_list<int> signals, absl::AnyInvocable<void(int)> on_signal) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals) sigaddset(&set, s);
  int fd = signalfd(-1, &set, SFD_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("signalfd: ", std::strerror(errno)));
  std::unique_ptr<SignalWatcher> w(new SignalWatcher(loop, UniqueFd(fd), std::move(on_signal)));
  w->ArmRead();
  return w;
}

SignalWatcher::SignalWatcher(Loop& loop, UniqueFd fd, absl::AnyInvocable<void(int)> on_signal)
    : loop_(loop), fd_(std::move(fd)), on_signal_(std::move(on_signal)) {
  read_.callback = [this](int32_t res, bool /*more*/) {
    if (res == static_cast<int32_t>(sizeof(info_))) {
      on_signal_(static_cast<int>(info_.ssi_signo));
    } else if (res < 0 && res != -ECANCELED) {
      LOG(ERROR) << "reading signalfd: " << std::strerror(-res);
    }
    if (res != -ECANCELED && loop_.running()) ArmRead();
  };
}

void SignalWatcher::ArmRead() { loop_.Read(&read_, fd_.get(), &info_, sizeof(info_), 0); }

}  // namespace fusekeeper
