// One instance of a launched program (launcher.h), on the launcher's loop: its processes, the
// fusermount that hands it the connection (a second mount is refused, so each instance gets its
// own), its stderr (passed through, the last lines kept for the report), the reports of the
// relay's core in it, and how it ended.
//
// An instance has ended when every process of it has been reaped (the launcher is a child
// subreaper: a daemonizing program's real server too), its stderr and its reports have closed,
// and its exec has been heard of. Nothing here waits: the exec's outcome comes on a pipe, the
// ends as the launcher's SIGCHLD (Reap).
//
// Threading: the loop's thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "agent/base/unique_fd.h"
#include "agent/fkserve/fusermount.h"
#include "agent/fkserve/launcher.h"
#include "agent/loop/loop.h"
#include "agent/loop/poll_watch.h"

namespace fusekeeper {

// The launcher's private directory: the program's mount point, the fusermount links, the
// fusermount socket. Removed when it goes.
struct PrivateDir {
  std::string dir, mountpoint, bin, socket;
  ~PrivateDir();
};
bool MakePrivateDir(const LaunchOptions& o, PrivateDir* d, std::string* error);

// The launcher's children, as this process's pid namespace numbers them: the program, and (as a
// subreaper) whatever it left running.
std::set<pid_t> Children();
// "exited with status N" / "was killed by signal N".
std::string Describe(int status);

class ProgramInstance {
 public:
  struct Spec {
    const LaunchOptions* options;
    const PrivateDir* dir;
    int conn;      // the connection, or the relay's socket for it
    bool relayed;  // conn is the relay's socket
    // Relayed, what answers the preload library's claim of the kernel's connection
    // (relay/in_program.h); none: the program stays on the launcher's hop.
    FusermountService::ClaimHandler claim;
    // Every problem fkserve's fusermount reports.
    std::function<void(const std::string&)> on_problem;
    // The exec's outcome ("" once the program runs; else why it could not start).
    std::function<void(const std::string& error)> on_exec;
    // Every process of the instance has ended, and its stderr and reports have closed.
    std::function<void()> on_end;
  };
  // Forks and execs; nullptr with *error if it could not get that far.
  static std::unique_ptr<ProgramInstance> Start(Loop& loop, Spec spec, std::string* error);
  ~ProgramInstance();

  // The launcher's SIGCHLD: reaps what has ended (every child of the launcher is this instance's),
  // and says when a process of it was stopped or continued.
  void Reap();
  // The connection of a claim (a dup): its reports are read until it closes, `on_line` each.
  void AddReports(UniqueFd conn, std::function<void(const std::string& line)> on_line);

  bool exec_failed() const { return !exec_error_.empty(); }
  const std::string& exec_error() const { return exec_error_; }
  std::chrono::steady_clock::time_point started() const { return started_; }
  // Once ended: why, in words ("<name> exited with status 1"; a daemonizing program's last
  // process too), and the wait status that stands for the whole.
  std::string why() const;
  int status() const;
  // The last lines of its stderr ("" if none).
  std::string LastWords() const;
  const std::vector<std::string>& problems() const { return service_->problems(); }
  void StopProblems() { service_->OnProblem(nullptr); }

 private:
  ProgramInstance(Loop& loop, Spec spec) : loop_(loop), spec_(std::move(spec)) {}
  void ReadStderr();
  void KeepLine(const std::string& line);
  void MaybeEnded();

  Loop& loop_;
  Spec spec_;
  std::string name_;
  std::unique_ptr<FusermountService> service_;
  pid_t child_ = -1;
  std::chrono::steady_clock::time_point started_;
  UniqueFd exec_pipe_, stderr_;
  std::unique_ptr<PollWatch> exec_watch_, stderr_watch_;
  bool exec_known_ = false, processes_gone_ = false, ended_ = false;
  std::string exec_error_;
  std::string pending_;             // a stderr line not ended yet
  std::vector<std::string> lines_;  // the last ones
  struct Reports {
    UniqueFd fd;
    std::unique_ptr<PollWatch> watch;
  };
  std::vector<std::unique_ptr<Reports>> reports_;
  // The reaping: the program's own status, and the last process's.
  int program_status_ = 0, last_status_ = 0, reaped_ = 0;
  pid_t last_pid_ = -1;
  bool program_done_ = false;
};

}  // namespace fusekeeper
