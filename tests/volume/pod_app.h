// An application in a pod, for restart tests: a process of its own that enters a container-like
// view of the pod's target (Reader::EnterPodView), becomes the app's uid, and runs `body`, which
// reports on a socket: "+" a step done, "-<what>" an error (the operation and errno), "=ok" or
// "=failed" the answer to a command the test sent (Ask). The body polls for commands with
// NextCommand between steps. A process, not a thread (pod_reader.h says why); it dies with the test.
#pragma once

#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/volume/pod_reader.h"

namespace fusekeeper {

class PodApp {
 public:
  using Body = std::function<void(const std::string& view, int out)>;

  PodApp(const std::string& target, const std::string& view_dir, uid_t uid, const Body& body) {
    pid_ = Reader::ForkReporting(&fd_, [&](int out) {
      Reader::EnterPodView(target.c_str(), view_dir.c_str(), out);
      if (setresgid(uid, uid, uid) != 0 || setresuid(uid, uid, uid) != 0) Report(out, Err("setresuid")), _exit(1);
      body(view_dir, out);
      _exit(0);
    });
    thread_ = std::thread([this] { Collect(); });
  }
  ~PodApp() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    shutdown(fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    close(fd_);
  }

  // Blocking: until `n` more steps have completed (false if the deadline passed first).
  bool WaitForSteps(int64_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t want = steps_ + n;
    return cv_.wait_for(lock, kReaderDeadline, [&] { return steps_ >= want || ended_; }) && steps_ >= want;
  }
  // Blocking: until `total` steps have completed since the app started (false if the deadline
  // passed first). For an app that makes a fixed number of steps: they may all be done before
  // the test asks, which WaitForSteps would wait past.
  bool WaitForStepsInAll(int64_t total) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kReaderDeadline, [&] { return steps_ >= total || ended_; }) && steps_ >= total;
  }
  // Blocking: sends `command` and waits for its answer ("=ok": true), within `limit`.
  bool Ask(char command, std::chrono::milliseconds limit = kReaderDeadline) {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t want = answers_ + 1;
    (void)!send(fd_, &command, 1, MSG_NOSIGNAL);
    cv_.wait_for(lock, limit, [&] { return answers_ >= want || ended_; });
    return answers_ >= want && last_answer_ok_;
  }
  int64_t steps() {
    std::lock_guard<std::mutex> lock(mu_);
    return steps_;
  }
  std::vector<std::string> errors() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out = errors_;
    if (more_errors_ > 0) out.push_back("and " + std::to_string(more_errors_) + " more");
    return out;
  }
  size_t error_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return errors_.size() + static_cast<size_t>(more_errors_);
  }
  // Errors whose report starts with `kind` (all of them, not only the ones kept).
  int64_t errors_of_kind(char kind) {
    std::lock_guard<std::mutex> lock(mu_);
    return by_kind_[static_cast<unsigned char>(kind)];
  }

  // In the app's process.
  static void Report(int out, const std::string& m) {
    if (send(out, m.data(), m.size(), MSG_NOSIGNAL) < 0) _exit(0);
  }
  static std::string Err(const std::string& what) { return "-" + what + ": " + strerror(errno); }
  // A command the test sent (0: none yet). Never blocks.
  static char NextCommand(int out) {
    char c;
    return recv(out, &c, 1, MSG_DONTWAIT) == 1 ? c : 0;
  }

 private:
  void Collect() {
    char msg[512];
    ssize_t n;
    while ((n = recv(fd_, msg, sizeof(msg), 0)) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      if (msg[0] == '+') {
        ++steps_;
      } else if (msg[0] == '=') {
        last_answer_ok_ = std::string(msg, static_cast<size_t>(n)) == "=ok";
        ++answers_;
      } else {
        if (n > 1) ++by_kind_[static_cast<unsigned char>(msg[1])];
        // The first ones say what went wrong; and the first few of each kind.
        if (errors_.size() < 20 || (n > 1 && by_kind_[static_cast<unsigned char>(msg[1])] <= 5)) {
          errors_.emplace_back(msg + 1, static_cast<size_t>(n) - 1);
        } else {
          ++more_errors_;
        }
      }
      cv_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
    cv_.notify_all();
  }

  pid_t pid_ = -1;
  int fd_ = -1;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t steps_ = 0;
  int64_t answers_ = 0;
  bool last_answer_ok_ = false;
  bool ended_ = false;
  std::vector<std::string> errors_;
  int64_t more_errors_ = 0;
  int64_t by_kind_[256] = {};
};

}  // namespace fusekeeper
