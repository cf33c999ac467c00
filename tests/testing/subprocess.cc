#include "tests/testing/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <poll.h>
#include <sys/inotify.h>
#include <sstream>

#include "glog/logging.h"

namespace fusekeeper {

extern "C" char** environ;

Subprocess::Subprocess(std::vector<std::string> argv, std::vector<std::string> extra_env,
                       std::function<void()> pre_exec) {
  char tmpl[] = "/tmp/fk-stderr-XXXXXX";
  int err_fd = mkostemp(tmpl, O_CLOEXEC);
  PCHECK(err_fd >= 0);
  stderr_path_ = tmpl;
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    bool overridden = false;
    for (const std::string& x : extra_env) {
      if (entry.compare(0, x.find('=') + 1, x, 0, x.find('=') + 1) == 0) overridden = true;
    }
    if (!overridden) env_storage.push_back(entry);
  }
  for (const std::string& x : extra_env) env_storage.push_back(x);
  std::vector<char*> envp;
  for (auto& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_ = fork();
  PCHECK(pid_ >= 0);
  if (pid_ == 0) {
    // Child: unblock everything the test runner may have blocked, so signals behave normally.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    dup2(err_fd, STDERR_FILENO);
    int devnull = open("/dev/null", O_RDWR);
    dup2(devnull, STDIN_FILENO);
    if (pre_exec) pre_exec();
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  close(err_fd);
  pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid_, 0));
  PCHECK(pidfd_ >= 0);
}

Subprocess::~Subprocess() {
  if (!reaped_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (pidfd_ >= 0) close(pidfd_);
  unlink(stderr_path_.c_str());
}

void Subprocess::Signal(int signo) {
  if (!reaped_) kill(pid_, signo);
}

std::optional<int> Subprocess::Wait(std::chrono::milliseconds timeout) {
  if (reaped_) return status_;
  pollfd p{pidfd_, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return std::nullopt;
  int status = 0;
  PCHECK(waitpid(pid_, &status, 0) == pid_);
  reaped_ = true;
  status_ = status;
  return status;
}

int Subprocess::CountInStderr(const std::string& what) const {
  const std::string log = Stderr();
  int n = 0;
  for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++n;
  return n;
}

bool Subprocess::WaitForStderr(const std::string& what, int count, std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int in = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (in < 0) return false;
  inotify_add_watch(in, stderr_path_.c_str(), IN_MODIFY);
  bool found = false;
  while (!(found = CountInStderr(what) >= count)) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{in, POLLIN, 0};
    poll(&p, 1, static_cast<int>(left.count()));
    char buf[4096];
    while (read(in, buf, sizeof(buf)) > 0) {
    }
  }
  close(in);
  return found;
}

std::string Subprocess::Stderr() const {
  std::ifstream in(stderr_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string RunfilePath(const std::string& workspace_relative) {
  // Bazel runs tests from the runfiles tree of the main workspace.
  const char* srcdir = getenv("TEST_SRCDIR");
  const char* ws = getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && ws != nullptr) {
    return std::string(srcdir) + "/" + ws + "/" + workspace_relative;
  }
  return workspace_relative;
}

ShortTempDir::ShortTempDir() {
  char tmpl[] = "/tmp/fk-XXXXXX";
  PCHECK(mkdtemp(tmpl) != nullptr);
  path_ = tmpl;
}

ShortTempDir::~ShortTempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace fusekeeper
