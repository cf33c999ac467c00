// The launcher (`fkserve launch -- <program> [args]`): runs another program, unmodified, on the
// connection the agent handed to fkserve.
//
// The program finds the connection in one of two ways:
//  - `/dev/fd/{fd}` as its mount point (libfuse3 accepts an fd there): `{fd}` is replaced by the
//    number of the inherited connection;
//  - an ordinary directory, `{mountpoint}` (one the launcher makes, empty): the program mounts it
//    the normal way, through fusermount, and fkserve's own fusermount (fusermount.h) answers with
//    the connection. The launcher puts it first on $PATH (go-fuse, bazil) and preloads
//    libfkserve_preload.so (libfuse2/3 exec fusermount by absolute path first).
//
// Relayed (LaunchOptions::relay, the default), the program never holds the kernel's connection:
// it gets one end of a socket pair as if it were the connection, the launcher relays (see
// relay/relay_core.h), and when every process of the program has ended the launcher starts it
// again on a new socket with the connection kept (bounded backoff; a crash loop is given up on
// and reported). Direct, the program gets the connection itself and its end ends the launcher.
//
// Programs that daemonize (sshfs or s3fs without -f, rclone --daemon) are followed: the launcher
// is a child subreaper, so their descendants stay its children; the server lives while any of
// them does, and its end is reported to the agent with the program's name and exit status (a
// plain exit 0 too). SIGTERM/SIGINT/SIGHUP are passed on to every one of them.
//
// Blocking: Launch runs the process's one loop (epoll) on the calling thread, the main one; every
// event (signals by signalfd, the program's processes, its stderr, fkserve's fusermount, the
// agent's connection, the relay) is handled there (launcher.cc, program_instance.h).
#pragma once

#include <sys/resource.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "agent/base/unique_fd.h"
#include "agent/fkserve/handoff_client.h"
#include "agent/fkserve/relay/durability.h"

namespace fusekeeper {

struct LaunchOptions {
  std::vector<std::string> program;  // argv, with {fd} and {mountpoint} placeholders
  std::string socket_path;           // the handoff socket (for re-deposits)
  uid_t agent_uid = 0;
  bool read_only = false;            // how the agent mounted the volume
  // Where the launcher's private directory may be made, tried in order (a container's root may
  // be read-only; the pod's emptyDir holding the socket is not).
  std::vector<std::string> work_dirs = {"/tmp"};
  std::string fusermount;            // fkserve-fusermount: the fusermount links point at it
  std::string preload;               // libfkserve_preload.so ("": none)
  std::function<void(bool)> mark_ready;  // serving starts (true) / ends (false)
  // Relayed (the default): the launcher keeps the kernel's connection, the program gets a socket
  // (relay/relay_core.h), and a program that dies is started again with the connection kept:
  // pods see slower answers, not errors. Direct: the program gets the connection itself.
  bool relay = true;
  // Relayed: the relay's core runs inside the program where the preload library can enter it
  // (relay/in_program.h): no second process on the request path. False: always the hop.
  bool in_program = true;
  // Restarts in a row of instances that each died before answering a request, before giving up
  // (the end is reported to the agent as for a direct program).
  int max_restarts = 8;
  // An instance that dies sooner than this after its start is restarted after a growing delay
  // (100 ms doubling to 5 s); one that lived longer, at once.
  std::chrono::milliseconds stable_after{10000};
  // > 0: a server pod's (MountConfig::drain_ms): asked to stop, the launcher serves on until the
  // agent's successor waits, for at most this long (agent_link.h).
  int64_t drain_ms = 0;
  // Relayed: when the program makes a change durable, what a death may cost
  // (relay/durability.h): "write", "sync", "close", "unmount", or "auto" (known programs by
  // name, else "sync"). CheckDurability tells a bad value.
  std::string durability = "auto";
  // Relayed: an instance that has not answered the kernel's FUSE_INIT this long after its start
  // is killed (every process of it) and reported as a program that ended before serving (with
  // its last words). Zero: no bound. Below the agent's --init_timeout_ms, so the launcher says
  // why first.
  std::chrono::milliseconds init_timeout{20000};
  // Relayed: an instance with requests in flight (lock waits aside) that sends nothing for this
  // long is killed; the relay restarts it and resends them (a request in flight at three deaths
  // in a row fails with EIO), and the agent is told why (a notice: an Event). Zero: no bound.
  std::chrono::milliseconds program_stall{120000};
  // The open-file soft limit the program starts with: fkserve's own before it raised it
  // (fd_limit.h); 0: fkserve's.
  rlim_t program_fd_limit = 0;
};

// OK, or INVALID_ARGUMENT naming the accepted values.
absl::Status CheckDurability(const std::string& durability);
// The durability a launch uses (options.durability, resolved for "auto").
relay::Durability ResolveDurability(const LaunchOptions& options);

// Runs the program on `fuse_fd`, answering the handoff on `sock`; returns fkserve's exit status:
// the program's (128+signal if it was killed; 0 if the kernel's connection ended under it), and
// whether the connection ended (unmounted or aborted) rather than a stop or the program's own end. `relay_state`: the state a dead launcher of this
// connection deposited with the agent (a live config's second fd): relayed, the launcher carries
// on from it (the program is started as after a crash of its own); if it cannot, it asks the agent
// for a fresh connection on `sock`. Invalid: a new connection.
Served Launch(UniqueFd sock, UniqueFd fuse_fd, UniqueFd relay_state, const LaunchOptions& options);

// Replaces {fd} and {mountpoint} in each argument.
std::vector<std::string> ExpandProgramArgs(const std::vector<std::string>& program, int fd,
                                           const std::string& mountpoint);

}  // namespace fusekeeper
