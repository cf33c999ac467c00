// Test helper: run a binary as a child process, capture its stderr, wait for exit with a deadline
// (pidfd + poll: no sleeping), send it signals.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fusekeeper {

class Subprocess {
 public:
  // pre_exec runs in the child between fork and exec: async-signal-safe calls only.
  // extra_env entries ("K=V") are added to (and override) this process's environment.
  Subprocess(std::vector<std::string> argv, std::vector<std::string> extra_env = {},
             std::function<void()> pre_exec = nullptr);
  ~Subprocess();  // SIGKILLs and reaps the child if it is still running

  pid_t pid() const { return pid_; }
  void Signal(int signo);
  // Waits up to timeout; returns the exit status as from waitpid, or nullopt on timeout. Once the
  // child has been reaped, returns its status again.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  // Everything the child wrote to stderr so far (reads the capture file).
  std::string Stderr() const;
  // Waits (inotify on the capture file, no polling) until `what` occurs at least `count` times
  // in stderr; false after `timeout`.
  bool WaitForStderr(const std::string& what, int count, std::chrono::milliseconds timeout) const;
  int CountInStderr(const std::string& what) const;

 private:
  pid_t pid_ = -1;
  int pidfd_ = -1;
  std::string stderr_path_;
  bool reaped_ = false;
  int status_ = 0;
};

// Runfiles path of a binary built by this workspace, e.g. "agent/fusekeeper".
std::string RunfilePath(const std::string& workspace_relative);

// A fresh directory under /tmp (short enough for unix socket paths); removed recursively on
// destruction.
class ShortTempDir {
 public:
  ShortTempDir();
  ~ShortTempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace fusekeeper
