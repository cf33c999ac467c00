// fkserve's own fusermount: how an unmodified FUSE program is served on the agent's connection.
// The fusermount itself is fkserve-fusermount (fusermount_main.cc); this is the launcher's side.
//
// A program that cannot mount by itself (an unprivileged container never can) asks `fusermount`
// (libfuse2, bazil) or `fusermount3` (libfuse3, go-fuse) to mount its directory: it runs it with
// `-o <options> -- <mountpoint>` and `_FUSE_COMMFD=<fd>` (one end of a socket pair) in the
// environment, and receives the /dev/fuse fd back on that socket with SCM_RIGHTS (one data byte).
// `fkserve launch` puts this fusermount first (PATH, and an LD_PRELOAD shim for the absolute path
// libfuse execs first): instead of mounting, it answers with the connection the agent handed to
// the launcher, which it asks for on the launcher's socket (FusermountService). The options the program asked for are compared with
// what the agent mounted: harmless ones are accepted; ones that would change what the pod sees
// or its security are reported (stderr, and a notice to the agent: an Event), never silently
// dropped. `fusermount -u` unmounts nothing: the agent owns the mount.
//
// A static binary, fkserve-fusermount, linked as fusermount and fusermount3 in the launcher's
// private bin directory, so that it runs in any image it is copied into.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "agent/base/unique_fd.h"
#include "agent/fkserve/fusermount_protocol.h"
#include "agent/loop/loop.h"
#include "agent/loop/poll_watch.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

// What becomes of the mount options a program asks fusermount for.
struct OptionVerdict {
  std::vector<std::string> accepted;     // harmless, or what the agent's mount does anyway
  std::vector<std::string> not_applied;  // would change what the pod sees or its security: reported
};
// `options`: the comma-separated -o argument(s). `agent_read_only`: how the agent mounted.
OptionVerdict ClassifyMountOptions(const std::vector<std::string>& options, bool agent_read_only);

// The launcher's side: answers fusermount requests on a socket of its own, on the launcher's loop,
// until destroyed. It hands the connection over once (a second mount is refused), and prints and
// keeps what it reports. Every method on the loop's thread (or before the loop runs).
class FusermountService {
 public:
  // `socket_path`: a path in the launcher's private directory; `fuse_fd`: the connection (a dup
  // is kept); `agent_read_only`: how the agent mounted it. Binds and listens now.
  static std::unique_ptr<FusermountService> Start(Loop& loop, const std::string& socket_path, int fuse_fd,
                                                  bool agent_read_only, std::string* error);
  ~FusermountService();
  // What was refused or not applied (for the report to the agent).
  const std::vector<std::string>& problems() const { return problems_; }
  // Whether the connection was handed to a fusermount.
  bool handed() const { return handed_; }
  // `fn` gets every problem: those so far at once, later ones as they happen.
  void OnProblem(std::function<void(const std::string&)> fn);
  // The program's preload library claims the kernel's connection (relay/in_program.h): `fn`
  // gets the request's socket (to answer, and keep: a dup) and its two lines (socket inode, read
  // size). Without one, claims are refused. Before the program starts.
  using ClaimHandler = std::function<void(int conn, const std::string& inode, const std::string& read_size)>;
  void OnClaim(ClaimHandler fn) { on_claim_ = std::move(fn); }

 private:
  // A client that connected: answered when its request comes, dropped if none comes in time.
  struct Client {
    UniqueFd fd;
    std::unique_ptr<PollWatch> watch;
    std::unique_ptr<Timer> timeout;
  };
  explicit FusermountService(Loop& loop) : loop_(loop) {}
  void Accept();
  void Answer(int conn);
  void Drop(int conn);
  void AddProblem(const std::string& p);
  Loop& loop_;
  UniqueFd listen_fd_, fuse_fd_;
  std::unique_ptr<PollWatch> listening_;
  std::map<int, Client> clients_;
  bool agent_read_only_ = false;
  bool handed_ = false;
  std::vector<std::string> problems_;
  std::function<void(const std::string&)> on_problem_;
  ClaimHandler on_claim_;
};

}  // namespace fusekeeper
