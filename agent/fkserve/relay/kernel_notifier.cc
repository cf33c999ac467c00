#include "agent/fkserve/relay/kernel_notifier.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace fusekeeper::relay {

KernelNotifier::KernelNotifier(int kernel_fd, std::function<void(const std::string&)> log)
    : shared_(std::make_shared<Shared>()) {
  // Blocking writes are fine here (the connection's open file may be non-blocking: writes to
  // /dev/fuse ignore it).
  shared_->fd = UniqueFd(fcntl(kernel_fd, F_DUPFD_CLOEXEC, 3));
  shared_->log = std::move(log);
  std::thread([s = shared_] {
    sigset_t block;
    sigfillset(&block);
    pthread_sigmask(SIG_BLOCK, &block, nullptr);
    pthread_setname_np(pthread_self(), "fk-notify");
    std::unique_lock<std::mutex> lock(s->mu);
    for (;;) {
      s->cv.wait(lock, [&] { return s->stopping || !s->queue.empty(); });
      if (s->stopping) return;
      std::string m = std::move(s->queue.front());
      s->queue.pop_front();
      lock.unlock();
      ssize_t n;
      do {
        n = write(s->fd.get(), m.data(), m.size());
      } while (n < 0 && errno == EINTR);
      // ENOENT: the kernel no longer has what it names; ENODEV: the connection ended.
      if (n < 0 && errno != ENOENT && errno != ENODEV && s->log) {
        s->log(absl::StrCat("relay: passing a notification of ", m.size(), " bytes to the kernel: ", strerror(errno)));
      }
      lock.lock();
    }
  }).detach();
}

KernelNotifier::~KernelNotifier() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->stopping = true;
  shared_->queue.clear();
  shared_->cv.notify_all();
}

void KernelNotifier::Push(const char* data, size_t len) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  if (shared_->queue.size() >= kMaxQueued) {
    if (!dropped_logged_ && shared_->log) {
      dropped_logged_ = true;
      shared_->log(absl::StrCat("relay: over ", kMaxQueued, " notifications wait for the kernel; dropping them"));
    }
    return;
  }
  shared_->queue.emplace_back(data, len);
  shared_->cv.notify_one();
}

}  // namespace fusekeeper::relay
