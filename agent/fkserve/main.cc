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
// serving (with the program's exit status) is reported to the agent on it. Exit codes: 0 served until unmounted; 2 usage; 3 cannot reach the socket or the peer
// is not the agent; 4 the agent refused or sent something that is not a FUSE device; 5 serving failed;
// launch: the program's own status (127 if it could not be started).
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/inotify.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "agent/fkserve/agent_link.h"
#include "agent/fkserve/launcher.h"
#include "agent/fkserve/stop_signals.h"
#include "agent/fkserve/tools.h"
#include "agent/fkserve/passthrough.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/version.h"
#include "gflags/gflags.h"

DEFINE_string(socket, getenv("FUSEKEEPER_SOCKET") != nullptr ? getenv("FUSEKEEPER_SOCKET") : "",
              "the volume's handoff socket (from the agent; default $FUSEKEEPER_SOCKET, which a server pod "
              "the agent makes has)");
DEFINE_int32(socket_wait_ms, 120000,
             "how long to wait for the handoff socket to appear (or its agent to listen): a server pod "
             "starts before the agent has found its emptyDir");
DEFINE_string(root, "", "serve: the directory to export");
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
             "launch (relayed): a program with requests in flight (lock waits aside) that sends nothing for "
             "this long is killed; the relay restarts it and resends them, and the agent is told why (an "
             "Event). 0: no bound");
DEFINE_string(ready_file, "",
              "created once the volume is served (removed when serving ends); `fkserve "
              "--ready_file=F ready` exits 0 only if it exists: a startupProbe, so that a pod's app "
              "containers start only after the handoff");

namespace {

// Until a mode installs its own: PID 1 of a container ignores signals it has no handler for, so
// without these kubelet's SIGTERM would be waited out for the pod's whole grace period.
void ExitOnStopSignal(int sig) { _exit(128 + sig); }


using fusekeeper::UniqueFd;

// The --ready_file marker: created when serving starts, removed when it ends.
void MarkReady(bool ready) {
  if (FLAGS_ready_file.empty()) return;
  if (!ready) {
    unlink(FLAGS_ready_file.c_str());
    return;
  }
  int fd = open(FLAGS_ready_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    fprintf(stderr, "fkserve: creating --ready_file %s: %s\n", FLAGS_ready_file.c_str(), strerror(errno));
    return;
  }
  close(fd);
}

int Fail(int code, const std::string& message) {
  fprintf(stderr, "fkserve: %s\n", message.c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  // The mode and the launched program come from the original argv: gflags reorders it, and
  // nothing after "--" may be mistaken for our own flags.
  std::string mode;
  std::string mode_arg;  // install-tools <dir>
  std::vector<std::string> program;
  bool after_dashes = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (after_dashes) {
      program.push_back(a);
    } else if (a == "--") {
      after_dashes = true;
    } else if (mode.empty() && a.rfind("-", 0) != 0) {
      mode = a;
    } else if (mode_arg.empty() && a.rfind("-", 0) != 0) {
      mode_arg = a;
    }
  }
  gflags::SetVersionString(fusekeeper::kVersion);
  gflags::SetUsageMessage(
      "fkserve --socket=<handoff socket> serve --root=<dir>\n"
      "fkserve --socket=<handoff socket> launch -- <program> [args with {fd}]\n"
      "fkserve --ready_file=<file> ready   (a startupProbe: 0 once serving)\n"
      "fkserve install-tools <dir>   (the launcher, its fusermount and libraries, for another image)");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  fusekeeper::HandleStopSignals(ExitOnStopSignal, /*restart=*/true);
  if (mode.empty()) return Fail(2, gflags::ProgramUsage());
  if (mode == "install-tools") {
    if (mode_arg.empty()) return Fail(2, "install-tools needs a directory");
    std::string loader;
    if (auto s = fusekeeper::InstallToolsBlocking(mode_arg, &loader); !s.ok()) return Fail(1, std::string(s.message()));
    printf("installed in %s: run %s/lib/%s --library-path %s/lib %s/fkserve --fusermount=%s/fkserve-fusermount "
           "--preload=%s/libfkserve_preload.so ...\n",
           mode_arg.c_str(), mode_arg.c_str(), loader.c_str(), mode_arg.c_str(), mode_arg.c_str(), mode_arg.c_str(),
           mode_arg.c_str());
    return 0;
  }
  if (mode == "ready") {
    if (FLAGS_ready_file.empty()) return Fail(2, "ready needs --ready_file");
    if (access(FLAGS_ready_file.c_str(), F_OK) == 0) return 0;
    return Fail(1, absl::StrCat("not serving yet (no ", FLAGS_ready_file, ")"));
  }
  if (mode != "serve" && mode != "launch") return Fail(2, absl::StrCat("unknown mode '", mode, "'"));
  if (FLAGS_socket.empty()) return Fail(2, "--socket is required");
  if (mode == "serve" && FLAGS_root.empty()) return Fail(2, "serve needs --root=<directory to export>");
  if (auto s = fusekeeper::CheckDurability(FLAGS_durability); !s.ok()) return Fail(2, std::string(s.message()));
  if (FLAGS_init_timeout_ms < 0 || FLAGS_program_stall_ms < 0) {
    return Fail(2, "--init_timeout_ms and --program_stall_ms must be >= 0 (0: no bound)");
  }

  fprintf(stderr, "fkserve: connecting to %s\n", FLAGS_socket.c_str());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (FLAGS_socket.size() >= sizeof(addr.sun_path)) {
    return Fail(3, absl::StrCat("socket path ", FLAGS_socket, " is longer than 107 bytes; "
                                "pass it through a shorter path or /proc/self/fd/<dirfd>/name"));
  }
  memcpy(addr.sun_path, FLAGS_socket.data(), FLAGS_socket.size());
  UniqueFd sock;
  {
    // Until the socket is there and listened on, or --socket_wait_ms: woken by its directory
    // changing (inotify), and once a second in any case (a socket re-bound in place).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(0, FLAGS_socket_wait_ms));
    const std::string dir = FLAGS_socket.find('/') == std::string::npos
                                ? "."
                                : FLAGS_socket.substr(0, std::max<size_t>(1, FLAGS_socket.rfind('/')));
    UniqueFd watch(inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
    if (watch.valid()) inotify_add_watch(watch.get(), dir.c_str(), IN_CREATE | IN_MOVED_TO | IN_ATTRIB);
    bool said = false;
    for (;;) {
      // Events so far are drained before the attempt, never after it: a change that lands
      // between the attempt and the poll still wakes the poll.
      char drain[4096];
      while (watch.valid() && read(watch.get(), drain, sizeof(drain)) > 0) {
      }
      sock.Reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
      if (connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) break;
      const int err = errno;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      // EACCES too: the agent makes the socket, then gives it to the server's user (chown).
      if ((err != ENOENT && err != ECONNREFUSED && err != EACCES) || left.count() <= 0) {
        return Fail(3, absl::StrCat("cannot connect to ", FLAGS_socket, ": ", strerror(err),
                                    err == ENOENT ? " (does the agent publish this volume?)" : ""));
      }
      if (!said) {
        fprintf(stderr, "fkserve: %s: %s; waiting up to %d ms for the agent\n", FLAGS_socket.c_str(), strerror(err),
                FLAGS_socket_wait_ms);
        said = true;
      }
      pollfd p{watch.get(), POLLIN, 0};
      poll(&p, watch.valid() ? 1 : 0, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    }
  }
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(sock.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
      cred.uid != static_cast<uid_t>(FLAGS_agent_uid)) {
    return Fail(3, absl::StrCat("the peer on ", FLAGS_socket, " runs as uid ", cred.uid,
                                ", not the agent's uid ", FLAGS_agent_uid, "; refusing it"));
  }
  // A live connection this mode cannot adopt is answered with a request for a fresh one, which
  // the agent sends on the same socket.
  absl::StatusOr<fusekeeper::ReceivedMessage> msg;
  absl::StatusOr<fusekeeper::MountConfig> config;
  for (int round = 0;; ++round) {
    msg = fusekeeper::ReceiveHandoffMessage(sock.get());
    if (!msg.ok()) return Fail(4, absl::StrCat("receiving from the agent: ", msg.status().message()));
    config = fusekeeper::DecodeMountConfig(msg->payload);
    if (!config.ok()) return Fail(4, std::string(config.status().message()));
    struct stat st;
    if (!msg->fd.valid() || fstat(msg->fd.get(), &st) != 0 || !S_ISCHR(st.st_mode) ||
        major(st.st_rdev) != 10 || minor(st.st_rdev) != 229) {
      fusekeeper::ReplyToAgent(sock.get(), false, "the fd received is not /dev/fuse");
      return Fail(4, "the agent's message did not carry a /dev/fuse fd");
    }
    // `serve` replays the first server's INIT; a relayed `launch` carries on from the relay state
    // the launcher before it deposited with the agent.
    // Blocking, as libfuse and the launched programs expect it (a relay before us read it
    // non-blocking; the flag is the open file's).
    if (const int fl = fcntl(msg->fd.get(), F_GETFL); fl >= 0 && (fl & O_NONBLOCK)) {
      fcntl(msg->fd.get(), F_SETFL, fl & ~O_NONBLOCK);
    }
    const bool can_adopt = (mode == "serve" && !config->init.empty()) ||
                           (mode == "launch" && !FLAGS_direct && config->relay_state && msg->fd2.valid());
    if (!config->live || can_adopt) break;
    if (round > 0) return Fail(4, "the agent offered a live connection again after a fresh one was asked for");
    fprintf(stderr, "fkserve: volume %s: cannot adopt the live connection in %s mode; asking for a fresh one\n",
            config->volume_id.c_str(), mode.c_str());
    fusekeeper::ReplyToAgent(sock.get(), false, absl::StrCat(mode, " mode cannot adopt a live connection"), /*fresh=*/true);
  }
  fprintf(stderr, "fkserve: serving volume %s (%s%s)\n", config->volume_id.c_str(), mode.c_str(),
          config->live ? ", adopting the live connection" : "");

  if (mode == "launch") {
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
    return fusekeeper::Launch(std::move(sock), std::move(msg->fd),
                              config->live ? std::move(msg->fd2) : UniqueFd(), lo);
  }

  fusekeeper::PassthroughOptions options;
  options.root = FLAGS_root;
  options.read_only = config->read_only;
  options.mount_group = config->mount_group;
  struct stat root_st;
  if (stat(FLAGS_root.c_str(), &root_st) != 0 || !S_ISDIR(root_st.st_mode)) {
    fusekeeper::ReplyToAgent(sock.get(), false, absl::StrCat("export root ", FLAGS_root, " is not a directory this server can see"));
    return Fail(5, absl::StrCat("--root ", FLAGS_root, " is not a directory"));
  }
  if (config->live) {
    options.init_request = config->init;
    options.live = true;
  } else {
    // Read the INIT now, to report it: a successor adopting this connection replays it.
    auto init = fusekeeper::ReadInitRequest(msg->fd.get(), 10000);
    if (!init.ok()) {
      fusekeeper::ReplyToAgent(sock.get(), false, std::string(init.status().message()));
      return Fail(5, std::string(init.status().message()));
    }
    options.init_request = std::move(*init);
  }
  fusekeeper::ReplyToAgent(sock.get(), true, "", false, config->live ? "" : options.init_request);
  // The connection stays open while we serve (and is re-deposited with a restarted agent); its
  // end (and why) is reported to the agent.
  fusekeeper::AgentLink link(std::move(sock), UniqueFd(fcntl(msg->fd.get(), F_DUPFD_CLOEXEC, 3)),
                             options.init_request, FLAGS_socket, static_cast<uid_t>(FLAGS_agent_uid));
  // A server pod's server drains: asked to stop, it serves on until the agent's successor waits.
  link.set_drain_ms(config->drain_ms);
  link.Start();
  MarkReady(true);
  absl::Status s = fusekeeper::ServePassthrough(msg->fd.Release(), options);
  MarkReady(false);
  link.Report(s.ok(), s.ok() ? "" : std::string(s.message()));
  if (!s.ok()) return Fail(5, std::string(s.message()));
  return 0;
}
