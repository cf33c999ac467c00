// Readers that behave like an application in a pod: a process that reads a file over and over.
//
// A *pod view* reader reads the way a container does on a real node: from its own mount
// namespace, through a copy of the pod's volume target that containerd would make for
// `mountPropagation: HostToContainer` (the target bound recursively at another path, then marked
// rslave). Only mounts stacked on the target's mount reach such a copy; a target unmounted and
// mounted again in its place never does. Recovery tests read through both views.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "tests/testing/subprocess.h"

namespace fusekeeper {

// Reads `path` over and over (open, read, close) in a process of its own, as a pod would, and
// counts what happened. A process, not a thread: the test process forks servers, and a fork
// child inherits open FUSE files, whose close-on-exec sends FUSE_FLUSH to the very server being
// started (a deadlock no real pod has).
class Reader {
 public:
  // Reads `path` in the test's (the host's) mount namespace.
  explicit Reader(std::string path) : Reader(std::move(path), "", "") {}
  // Reads `file` below pod target `target` as a container would: `view_dir` (an empty directory)
  // becomes, in a mount namespace of the reader's own, an rslave recursive bind of the target.
  static std::unique_ptr<Reader> InPod(const std::string& target, const std::string& file,
                                       const std::string& view_dir) {
    return std::unique_ptr<Reader>(new Reader(view_dir + "/" + file, target, view_dir));
  }
  ~Reader() { Stop(); }
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);  // a read stuck on a dead mount is killable
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
    thread_.join();
  }
  int64_t reads() const { return state_->reads; }
  int64_t errors() const { return state_->errors; }
  // Why the pod view could not be set up (empty: it was, or this is a host reader).
  std::string setup_error() const {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->setup_error;
  }
  // Waits until `n` more successful reads of `want` in a row have happened.
  bool WaitForReadsOf(const std::string& want, int n = 5) {
    std::unique_lock<std::mutex> lock(state_->mu);
    const int64_t start = state_->last == want ? state_->matching : 0;
    return state_->cv.wait_for(lock, kTestDeadline, [&] {
      return !state_->setup_error.empty() || (state_->last == want && state_->matching >= start + n);
    }) && state_->setup_error.empty();
  }
  // The last thing read ("" after an error).
  std::string last() const {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->last;
  }

 private:
  Reader(std::string path, std::string target, std::string view_dir) : state_(std::make_shared<State>()) {
    state_->path = std::move(path);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) abort();
    pid_ = fork();
    if (pid_ < 0) abort();
    if (pid_ == 0) {
      close(sv[0]);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (!view_dir.empty()) EnterPodView(target.c_str(), view_dir.c_str(), sv[1]);
      ReadForever(state_->path.c_str(), sv[1]);
    }
    close(sv[1]);
    thread_ = std::thread([s = state_, fd = sv[0]] { Collect(*s, fd); });
  }

  struct State {
    std::string path;
    mutable std::mutex mu;
    std::condition_variable cv;
    std::atomic<int64_t> reads{0}, errors{0};
    int64_t matching = 0;
    std::string last;
    std::string setup_error;
  };
  // Child: what containerd does for a HostToContainer volume mount.
  static void EnterPodView(const char* target, const char* view, int out) {
    const char* step = nullptr;
    if (unshare(CLONE_NEWNS) != 0) {
      step = "unshare(CLONE_NEWNS)";
    } else if (mount(target, view, nullptr, MS_BIND | MS_REC, nullptr) != 0) {
      step = "rbind of the target";
    } else if (mount(nullptr, view, nullptr, MS_SLAVE | MS_REC, nullptr) != 0) {
      step = "making the view rslave";
    }
    if (step == nullptr) return;
    char msg[256];
    const int len = snprintf(msg, sizeof(msg), "!%s: %s", step, strerror(errno));
    send(out, msg, static_cast<size_t>(len), MSG_NOSIGNAL);
    _exit(1);
  }
  // Child: one message per read: "+content" or "-errno".
  [[noreturn]] static void ReadForever(const char* path, int out) {
    char msg[512];
    while (true) {
      size_t len = 1;
      msg[0] = '+';
      int fd = open(path, O_RDONLY | O_CLOEXEC);
      ssize_t n = fd < 0 ? -1 : 0;
      while (fd >= 0 && (n = read(fd, msg + len, sizeof(msg) - len)) > 0) len += static_cast<size_t>(n);
      const int err = errno;
      if (fd >= 0) close(fd);
      if (n < 0) len = static_cast<size_t>(snprintf(msg, sizeof(msg), "-%d", err));
      if (send(out, msg, len, MSG_NOSIGNAL) < 0) _exit(0);
    }
  }
  static void Collect(State& s, int fd) {
    char msg[512];
    ssize_t n;
    while ((n = recv(fd, msg, sizeof(msg), 0)) > 0) {
      std::lock_guard<std::mutex> lock(s.mu);
      if (msg[0] == '+') {
        std::string got(msg + 1, static_cast<size_t>(n) - 1);
        ++s.reads;
        s.matching = got == s.last ? s.matching + 1 : 1;
        s.last = std::move(got);
      } else if (msg[0] == '!') {
        s.setup_error.assign(msg + 1, static_cast<size_t>(n) - 1);
      } else {
        ++s.errors;
        s.matching = 0;
        s.last.clear();
      }
      s.cv.notify_all();
    }
    close(fd);
  }

  std::shared_ptr<State> state_;
  pid_t pid_ = -1;
  std::thread thread_;
};

}  // namespace fusekeeper
