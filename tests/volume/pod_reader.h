// Readers that behave like an application in a pod: a process that reads a file over and over.
//
// A *pod view* reader reads the way a container does on a real node: from its own mount
// namespace, through a copy of the pod's volume target that containerd would make for
// `mountPropagation: HostToContainer` (the target bound recursively at another path, then marked
// rslave). Only mounts stacked on the target's mount reach such a copy; a target unmounted and
// mounted again in its place never does. Recovery tests read through both views.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "tests/testing/subprocess.h"

namespace fusekeeper {

// How long a reader waits for what it is asked to wait for.
inline constexpr std::chrono::seconds kReaderDeadline{20};

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
  // `pace_ms` > 0: one read per pace_ms at most (a load generator for many volumes at once; 0:
  // back to back).
  static std::unique_ptr<Reader> InPod(const std::string& target, const std::string& file,
                                       const std::string& view_dir, int pace_ms = 0) {
    return std::unique_ptr<Reader>(new Reader(view_dir + "/" + file, target, view_dir, pace_ms));
  }
  ~Reader() { Stop(); }
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);  // a read stuck on a dead mount is killable
    // ... but not a FUSE_FLUSH its exit sends to a mount nobody serves (a test that failed with
    // its server gone): that waits until the connection is aborted, which the fixture's agent
    // does only when it is stopped, after this. So it is waited for a while, then left (and
    // reaped by whoever inherits it): a failing test fails instead of hanging.
    const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid_, 0));
    pollfd p{pidfd, POLLIN, 0};
    if (pidfd < 0 || poll(&p, 1, 5000) == 1) {
      waitpid(pid_, nullptr, 0);
      thread_.join();
    } else {
      fprintf(stderr, "reader pid %d is stuck exiting on a FUSE mount nobody serves: not waited for\n", pid_);
      thread_.detach();  // it holds its own reference to the state
    }
    if (pidfd >= 0) close(pidfd);
    pid_ = -1;
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
    return state_->cv.wait_for(lock, kReaderDeadline, [&] {
      return !state_->setup_error.empty() || (state_->last == want && state_->matching >= start + n);
    }) && state_->setup_error.empty();
  }
  // Starts timing a disruption (benchmarks): see HealedAfterMark. `want` (if not empty) is what
  // a healed read returns, e.g. the content only the next server serves.
  void Mark(const std::string& want = "") {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->mark = Clock::now();
    state_->mark_want = want;
    state_->first_ok_after_mark.reset();
    state_->errors_after_mark = 0;
  }
  // Waits until reads work again after Mark(): the first successful read (of `want`, if given)
  // completed after the mark, followed by `stable` more. Returns the time from the mark, or
  // nullopt at the deadline.
  std::optional<std::chrono::microseconds> HealedAfterMark(int stable = 3) {
    std::unique_lock<std::mutex> lock(state_->mu);
    auto& st = *state_;
    const bool ok = st.cv.wait_for(lock, kReaderDeadline,
                                   [&] { return st.first_ok_after_mark.has_value() && st.matching > stable; });
    if (!ok) return std::nullopt;
    return std::chrono::duration_cast<std::chrono::microseconds>(*st.first_ok_after_mark - st.mark);
  }
  int64_t errors_after_mark() const {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->errors_after_mark;
  }
  // Child: what containerd does for a HostToContainer volume mount: `view` becomes, in a mount
  // namespace of the caller's own, an rslave recursive bind of `target`. On failure, reports
  // "!<step>: <error>" on `out` and exits.
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
  // Forks a process that reports on a socket (SOCK_SEQPACKET, one message per report) and dies
  // with the test: `child` runs in it with its end and never returns. Returns the child's pid;
  // *parent_fd gets the test's end.
  template <typename F>
  static pid_t ForkReporting(int* parent_fd, F child) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) abort();
    const pid_t pid = fork();
    if (pid < 0) abort();
    if (pid == 0) {
      close(sv[0]);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      child(sv[1]);
      _exit(0);
    }
    close(sv[1]);
    *parent_fd = sv[0];
    return pid;
  }
  // What a container (or kubelet) gets from stat(2) and statfs(2) of pod target `target`, seen
  // through a pod view at `view_dir` (an empty directory): the errno of each (0: it answered),
  // or nullopt if they had not both returned within `limit` (the process is then killed: a wait
  // on an unanswered FUSE request is killable).
  static std::optional<std::pair<int, int>> StatInPod(const std::string& target, const std::string& view_dir,
                                                      std::chrono::milliseconds limit) {
    int fd = -1;
    const pid_t pid = ForkReporting(&fd, [&](int out) {
      EnterPodView(target.c_str(), view_dir.c_str(), out);
      struct stat st;
      const int stat_err = stat(view_dir.c_str(), &st) == 0 ? 0 : errno;
      struct statfs sfs;
      const int statfs_err = statfs(view_dir.c_str(), &sfs) == 0 ? 0 : errno;
      char msg[64];
      const int len = snprintf(msg, sizeof(msg), "%d %d", stat_err, statfs_err);
      send(out, msg, static_cast<size_t>(len), MSG_NOSIGNAL);
    });
    pollfd p{fd, POLLIN, 0};
    std::optional<std::pair<int, int>> got;
    char msg[256] = {};
    if (poll(&p, 1, static_cast<int>(limit.count())) == 1) {
      const ssize_t n = recv(fd, msg, sizeof(msg) - 1, 0);
      int a = -1, b = -1;
      if (n > 0 && msg[0] != '!' && sscanf(msg, "%d %d", &a, &b) == 2) got = std::make_pair(a, b);
    }
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    close(fd);
    return got;
  }
  // The last thing read ("" after an error).
  std::string last() const {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->last;
  }

 private:
  using Clock = std::chrono::steady_clock;
  Reader(std::string path, std::string target, std::string view_dir, int pace_ms = 0)
      : state_(std::make_shared<State>()) {
    state_->path = std::move(path);
    int fd = -1;
    pid_ = ForkReporting(&fd, [&](int out) {
      if (!view_dir.empty()) EnterPodView(target.c_str(), view_dir.c_str(), out);
      ReadForever(state_->path.c_str(), out, pace_ms);
    });
    thread_ = std::thread([s = state_, fd] { Collect(*s, fd); });
  }

  struct State {
    std::string path;
    mutable std::mutex mu;
    std::condition_variable cv;
    std::atomic<int64_t> reads{0}, errors{0};
    int64_t matching = 0;
    std::string last;
    std::string setup_error;
    Clock::time_point mark;
    std::string mark_want;
    std::optional<Clock::time_point> first_ok_after_mark;
    int64_t errors_after_mark = 0;
  };
  // Child: one message per read: "+content" or "-errno".
  [[noreturn]] static void ReadForever(const char* path, int out, int pace_ms) {
    char msg[512];
    while (true) {
      if (pace_ms > 0) poll(nullptr, 0, pace_ms);  // the reader's rate, not a synchronisation
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
      const Clock::time_point now = Clock::now();
      if (msg[0] == '+') {
        std::string got(msg + 1, static_cast<size_t>(n) - 1);
        ++s.reads;
        if (!s.first_ok_after_mark && (s.mark_want.empty() || got == s.mark_want)) s.first_ok_after_mark = now;
        s.matching = got == s.last ? s.matching + 1 : 1;
        s.last = std::move(got);
      } else if (msg[0] == '!') {
        s.setup_error.assign(msg + 1, static_cast<size_t>(n) - 1);
      } else {
        ++s.errors;
        ++s.errors_after_mark;
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
