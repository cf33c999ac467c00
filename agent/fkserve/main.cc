// fkserve: fusekeeper's reference FUSE server. Unprivileged: it never mounts anything. It
// connects to the volume's handoff socket, receives the /dev/fuse connection the agent mounted,
// and serves it.
//
//   fkserve --socket=/path/to/handoff.sock serve --root=/data/to/export
//   fkserve --socket=/path/to/handoff.sock launch -- squashfuse image.sqfs /dev/fd/{fd}
//
// `serve` runs the built-in passthrough of --root. `launch` runs any libfuse3 program with the
// connection as /dev/fd/<n> ({fd} in its arguments is replaced by the number) and exits with its
// exit status. Either way the handoff connection stays open while serving, and the end of
// serving (with the program's exit status) is reported to the agent on it; a connection that ends
// (unmounted, aborted) is followed by the volume's next one on the same socket, until the socket
// is gone. Exit codes: 0 served until unmounted; 2 usage; 3 cannot reach the socket or the peer
// is not the agent; 4 the agent refused or sent something that is not a FUSE device; 5 serving failed;
// launch: the program's own status (127 if it could not be started).
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "agent/base/fd_limit.h"
#include "agent/fkserve/agent_link.h"
#include "agent/fkserve/handoff_client.h"
#include "agent/fkserve/launcher.h"
#include "agent/fkserve/relay/relay_state.h"
#include "agent/fkserve/stop_signals.h"
#include "agent/fkserve/tools.h"
#include "agent/fkserve/serve.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/loop/signals.h"
#include "agent/version.h"
#include "gflags/gflags.h"

DEFINE_string(socket, getenv("FUSEKEEPER_SOCKET") != nullptr ? getenv("FUSEKEEPER_SOCKET") : "",
              "the volume's handoff socket (from the agent; default $FUSEKEEPER_SOCKET, which a server pod "
              "the agent makes has)");
DEFINE_int32(socket_wait_ms, 120000,
             "how long to wait for the handoff socket to appear (or its agent to listen): a server pod "
             "starts before the agent has found its emptyDir; also how long a server whose connection ended "
             "asks for the volume's next one");
DEFINE_string(root, "", "serve: the directory to export");
DEFINE_bool(passthrough, true,
            "serve: FUSE passthrough for regular files where the kernel offers it (Linux 6.9+): the agent "
            "registers each opened file as a backing file of the connection, and the kernel reads, writes and "
            "maps it directly; an open the agent refuses is served the ordinary way. The table of which open "
            "files use which backing file is deposited with the agent, so a successor of this server shares "
            "them (README)");
DEFINE_bool(xattrs, true,
            "serve: extended attributes of the export; off, every xattr call answers ENOSYS, which spares each "
            "passthrough write the kernel's GETXATTR of security.capability (near native write speed)");
DEFINE_int32(agent_uid, 0, "the uid the agent runs as; any other peer is refused");
DEFINE_string(work_dir, "",
              "launch: where the launcher makes its private directory (the program's mount point, "
              "fkserve's fusermount); default $TMPDIR, /tmp, else the socket's directory");
DEFINE_string(fusermount, "auto",
              "launch: fkserve-fusermount, linked as fusermount/fusermount3 for the program (auto: next to "
              "fkserve)");
DEFINE_string(preload, "auto",
              "launch: libfkserve_preload.so, preloaded into the program so that libfuse finds fkserve's "
              "fusermount (auto: next to fkserve; empty: none)");
DEFINE_bool(direct, false,
            "launch: hand the kernel's connection to the program itself instead of relaying it (raw speed; "
            "but a program that dies ends the launcher, and its successor gets a fresh connection: pods see "
            "errors and lose their open files)");
DEFINE_int32(max_restarts, 8,
             "launch (relayed): restarts in a row of a program that keeps dying before it answers a request "
             "before the launcher gives up and reports it");
DEFINE_int32(restart_window_ms, 10000,
             "launch (relayed): a program that dies within this long of its start is restarted after a "
             "growing delay (100 ms doubling to 5 s) instead of at once");
DEFINE_bool(in_program, true,
            "launch, relayed: the relay's core runs inside the program (libfkserve_preload.so) where "
            "the program lets the library in (dynamically linked programs): requests take no extra hop. "
            "Static programs (Go) are relayed by the launcher either way; false: every program is");
DEFINE_string(durability, "auto",
              "launch (relayed): when the program stores a change, which decides what its death costs: "
              "write (before it answers it: nothing is lost, nothing replayed), sync (at fsync/close: what it "
              "answered since is written again into the next instance), close (after close: open files that "
              "were written get EIO at their next fsync/close), unmount (the same, and files closed since the "
              "mount are lost), auto (known programs by name, else sync)");
DEFINE_int32(init_timeout_ms, 20000,
             "launch (relayed): a program that has not answered the kernel's FUSE_INIT this long after its "
             "start is killed (every process of it) and reported to the agent with its last words, as one "
             "that ended before serving; below the agent's --init_timeout_ms (30 s). 0: no bound");
DEFINE_int32(program_stall_ms, 120000,
             "launch (relayed): a program with requests in flight (lock waits aside) that sends nothing and "
             "does no work (CPU time, bytes read or written by its processes) for this long is killed; the "
             "relay restarts it and resends them, and the agent is told why (an Event). 0: no bound");
DEFINE_string(ready_file, "",
              "created once the volume is served (removed when serving ends); `fkserve "
              "--ready_file=F ready` exits 0 only if it exists: a startupProbe, so that a pod's app "
              "containers start only after the handoff");

namespace {

// Until a mode installs its own: PID 1 of a container ignores signals it has no handler for, so
// without these kubelet's SIGTERM would be waited out for the pod's whole grace period.
void ExitOnStopSignal(int sig) { _exit(128 + sig); }


using fusekeeper::UniqueFd;

int Fail(int code, const std::string& message) {
  fprintf(stderr, "fkserve: %s\n", message.c_str());
  return code;
}

// Beside --ready_file while the server waits for its socket: why, for `ready` (a startupProbe's
// output is what kubelet's Unhealthy Event quotes).
std::string WaitingFile() { return FLAGS_ready_file + ".waiting"; }

void WriteMarker(const std::string& path, const std::string& text) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    fprintf(stderr, "fkserve: creating %s: %s\n", path.c_str(), strerror(errno));
    return;
  }
  (void)!write(fd, text.data(), text.size());
  close(fd);
}

// The --ready_file marker: created when serving starts, removed when it ends.
void MarkReady(bool ready) {
  if (FLAGS_ready_file.empty()) return;
  if (!ready) {
    unlink(FLAGS_ready_file.c_str());
    return;
  }
  unlink(WaitingFile().c_str());
  WriteMarker(FLAGS_ready_file, "");
}

// The server waits for its handoff socket (or its agent): said on stderr and to `ready`.
void SayWaiting(const std::string& why) {
  if (!FLAGS_ready_file.empty()) WriteMarker(WaitingFile(), why);
  fprintf(stderr, "fkserve: %s\n", why.c_str());
}

// `ready`: 0 once serving; else 1, saying why not (the server's own words while it waits).
int Ready() {
  if (access(FLAGS_ready_file.c_str(), F_OK) == 0) return 0;
  std::string why;
  if (FILE* f = fopen(WaitingFile().c_str(), "re"); f != nullptr) {
    char buf[1024];
    const size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    why.assign(buf, n);
  }
  return Fail(1, why.empty() ? absl::StrCat("not serving yet (no ", FLAGS_ready_file, ")")
                             : absl::StrCat("not serving yet: ", why));
}

// `launch`'s options: the flags, the volume's config, and where fkserve's tools are.
fusekeeper::LaunchOptions LaunchOptionsFromFlags(const std::vector<std::string>& program,
                                                 const fusekeeper::MountConfig* config,
                                                 const fusekeeper::FdLimit& fd_limit) {
  fusekeeper::LaunchOptions lo;
  lo.program = program;
  lo.socket_path = FLAGS_socket;
  lo.agent_uid = static_cast<uid_t>(FLAGS_agent_uid);
  lo.read_only = config->read_only;
  const char* tmpdir = getenv("TMPDIR");
  lo.work_dirs = {FLAGS_work_dir, tmpdir != nullptr ? tmpdir : "", "/tmp",
                  FLAGS_socket.substr(0, FLAGS_socket.rfind('/'))};
  // Beside fkserve unless told (fkserve run through its own loader from a tools directory:
  // /proc/self/exe is then the loader, so the webhook's sidecar passes both).
  char self[PATH_MAX];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  const std::string exe = len > 0 ? std::string(self, static_cast<size_t>(len)) : "";
  const std::string dir = exe.substr(0, exe.rfind('/') + 1);
  lo.fusermount = FLAGS_fusermount == "auto" ? dir + "fkserve-fusermount" : FLAGS_fusermount;
  if (access(lo.fusermount.c_str(), X_OK) != 0) {
    fprintf(stderr, "fkserve: no %s: a program given {mountpoint} will find no fusermount of fkserve's "
            "(set --fusermount)\n", lo.fusermount.c_str());
  }
  lo.preload = FLAGS_preload == "auto" ? dir + "libfkserve_preload.so" : FLAGS_preload;
  if (!lo.preload.empty() && access(lo.preload.c_str(), R_OK) != 0) {
    fprintf(stderr, "fkserve: no %s: programs that exec the system's fusermount by its absolute path "
            "(libfuse) will not find fkserve's (set --preload)\n", lo.preload.c_str());
    lo.preload.clear();
  }
  lo.mark_ready = MarkReady;
  lo.relay = !FLAGS_direct;
  lo.in_program = FLAGS_in_program;
  lo.max_restarts = FLAGS_max_restarts;
  lo.durability = FLAGS_durability;
  lo.stable_after = std::chrono::milliseconds(FLAGS_restart_window_ms);
  lo.drain_ms = config->drain_ms;
  lo.init_timeout = std::chrono::milliseconds(FLAGS_init_timeout_ms);
  lo.program_stall = std::chrono::milliseconds(FLAGS_program_stall_ms);
  lo.program_fd_limit = fd_limit.soft_before;
  return lo;
}

// The mode, its argument (install-tools <dir>) and the launched program, from the original argv:
// gflags reorders it, and nothing after "--" may be mistaken for our own flags.
struct Command {
  std::string mode, mode_arg;
  std::vector<std::string> program;
};
Command SplitArgs(int argc, char** argv) {
  Command c;
  bool after_dashes = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (after_dashes) {
      c.program.push_back(a);
    } else if (a == "--") {
      after_dashes = true;
    } else if (c.mode.empty() && a.rfind("-", 0) != 0) {
      c.mode = a;
    } else if (c.mode_arg.empty() && a.rfind("-", 0) != 0) {
      c.mode_arg = a;
    }
  }
  return c;
}

int InstallTools(const std::string& dir) {
  if (dir.empty()) return Fail(2, "install-tools needs a directory");
  std::string loader;
  if (auto s = fusekeeper::InstallToolsBlocking(dir, &loader); !s.ok()) return Fail(1, std::string(s.message()));
  printf("installed in %s: run %s/lib/%s --library-path %s/lib %s/fkserve --fusermount=%s/fkserve-fusermount "
         "--preload=%s/libfkserve_preload.so ...\n",
         dir.c_str(), dir.c_str(), loader.c_str(), dir.c_str(), dir.c_str(), dir.c_str(), dir.c_str());
  return 0;
}

// What the serving modes need of the flags, checked.
std::string CheckServingFlags(const std::string& mode) {
  if (mode != "serve" && mode != "launch") return absl::StrCat("unknown mode '", mode, "'");
  if (FLAGS_socket.empty()) return "--socket is required";
  if (mode == "serve" && FLAGS_root.empty()) return "serve needs --root=<directory to export>";
  if (auto s = fusekeeper::CheckDurability(FLAGS_durability); !s.ok()) return std::string(s.message());
  if (FLAGS_init_timeout_ms < 0 || FLAGS_program_stall_ms < 0) {
    return "--init_timeout_ms and --program_stall_ms must be >= 0 (0: no bound)";
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  const Command cmd = SplitArgs(argc, argv);
  gflags::SetVersionString(fusekeeper::kVersion);
  gflags::SetUsageMessage(
      "fkserve --socket=<handoff socket> serve --root=<dir>\n"
      "fkserve --socket=<handoff socket> launch -- <program> [args with {fd}]\n"
      "fkserve --ready_file=<file> ready   (a startupProbe: 0 once serving)\n"
      "fkserve install-tools <dir>   (the launcher, its fusermount and libraries, for another image)");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  fusekeeper::HandleStopSignals(ExitOnStopSignal, /*restart=*/true);
  if (cmd.mode.empty()) return Fail(2, gflags::ProgramUsage());
  if (cmd.mode == "install-tools") return InstallTools(cmd.mode_arg);
  if (cmd.mode == "ready") {
    if (FLAGS_ready_file.empty()) return Fail(2, "ready needs --ready_file");
    return Ready();
  }
  if (const std::string bad = CheckServingFlags(cmd.mode); !bad.empty()) return Fail(2, bad);
  // A relay holds fds per open file and per instance: the runtime's soft limit (1024) is raised.
  std::string fd_said;
  const fusekeeper::FdLimit fd_limit = fusekeeper::RaiseFdLimit(&fd_said);
  if (fd_limit.soft == fd_limit.soft_before && fd_limit.soft < fd_limit.hard) {
    fprintf(stderr, "fkserve: %s\n", fd_said.c_str());
  }

  fprintf(stderr, "fkserve: connecting to %s\n", FLAGS_socket.c_str());
  absl::StatusOr<UniqueFd> sock = fusekeeper::ConnectToAgentBlocking(
      FLAGS_socket, static_cast<uid_t>(FLAGS_agent_uid), std::chrono::milliseconds(FLAGS_socket_wait_ms), SayWaiting);
  if (!sock.ok()) return Fail(3, std::string(sock.status().message()));
  // `serve` replays the first server's INIT; a relayed `launch` carries on from the relay state
  // the launcher before it deposited with the agent. Any other live connection is refused for a
  // fresh one.
  auto can_adopt = [&](const fusekeeper::Handoff& h) {
    return (cmd.mode == "serve" && !h.config.init.empty()) ||
           (cmd.mode == "launch" && !FLAGS_direct && h.config.relay_state && h.relay_state.valid() &&
            fusekeeper::relay::StateJournal::LooksLikeOne(h.relay_state.get()));
  };
  absl::StatusOr<fusekeeper::Handoff> handoff = fusekeeper::ReceiveHandoffBlocking(sock->get(), cmd.mode, can_adopt);
  if (!handoff.ok()) return Fail(4, std::string(handoff.status().message()));
  // Serves each connection the volume gets: after an abort the agent mounts a fresh one on the
  // same socket, and this server takes it (handoff_client.h ReceiveNextHandoffBlocking).
  for (;;) {
    fprintf(stderr, "fkserve: serving volume %s (%s%s)\n", handoff->config.volume_id.c_str(), cmd.mode.c_str(),
            handoff->config.live ? ", adopting the live connection" : "");
    fusekeeper::Served served;
    if (cmd.mode == "launch") {
      const fusekeeper::LaunchOptions lo = LaunchOptionsFromFlags(cmd.program, &handoff->config, fd_limit);
      served = fusekeeper::Launch(std::move(*sock), std::move(handoff->fuse), std::move(handoff->relay_state), lo);
    } else {
      served = fusekeeper::Serve(std::move(*sock), std::move(*handoff),
                                 {.root = FLAGS_root, .passthrough = FLAGS_passthrough, .xattrs = FLAGS_xattrs,
                                  .socket_path = FLAGS_socket, .agent_uid = static_cast<uid_t>(FLAGS_agent_uid),
                                  .mark_ready = MarkReady});
    }
    if (!served.connection_ended) return served.code;
    // Serving blocked the stop signals (a signalfd took them): between connections they end
    // the process again.
    fusekeeper::UnblockSignals({SIGTERM, SIGINT, SIGHUP});
    fprintf(stderr, "fkserve: the connection ended; asking the agent for the volume's next one\n");
    auto next = fusekeeper::ReceiveNextHandoffBlocking(FLAGS_socket, static_cast<uid_t>(FLAGS_agent_uid), cmd.mode,
                                                       can_adopt, std::chrono::milliseconds(FLAGS_socket_wait_ms));
    if (absl::IsNotFound(next.status())) {
      fprintf(stderr, "fkserve: the volume's socket is gone (unpublished): done\n");
      return served.code;
    }
    if (!next.ok()) return Fail(3, std::string(next.status().message()));
    sock = std::move(next->sock);
    handoff = std::move(next->handoff);
  }
}
