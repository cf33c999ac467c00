// The server's side of the handoff, blocking (agent/fuse/handoff_endpoint.h is the agent's):
// reaching the volume's handoff socket, receiving the /dev/fuse connection the agent mounted,
// answering it, and reaching the agent again to re-deposit the connection after it restarted
// (AgentLink). fkserve's main() and AgentLink use it; nothing else in fkserve speaks the
// handoff.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"
#include "agent/fuse/handoff_protocol.h"

namespace fusekeeper {

// How fkserve names itself in its replies ("fkserve <version>").
std::string ServerName();

// One attempt: a connected handoff socket at `path` whose peer runs as `agent_uid`. The error's
// errno-like code is kept in the status: NOT_FOUND (no socket yet), UNAVAILABLE (nobody listens
// yet: ECONNREFUSED, or EACCES before the agent has given the socket to the server's user),
// PERMISSION_DENIED (the peer is not the agent), INVALID_ARGUMENT (a path too long).
// `nonblocking`: for a loop (ConnectSeqpacket); a full listen queue is UNAVAILABLE.
absl::StatusOr<UniqueFd> TryConnectToAgent(const std::string& path, uid_t agent_uid, bool nonblocking = false);

// Until the socket is there and listened on, or `wait` is up: woken by its directory changing
// (inotify), and once a second in any case (a socket re-bound in place). `waiting` is told once
// why it waits.
absl::StatusOr<UniqueFd> ConnectToAgentBlocking(const std::string& path, uid_t agent_uid,
                                                std::chrono::milliseconds wait,
                                                const std::function<void(const std::string&)>& waiting);

struct Handoff {
  MountConfig config;
  UniqueFd fuse;         // the connection, blocking
  UniqueFd relay_state;  // a live connection's relay state, if the agent sent one
};

// Receives the volume: the agent's config and its /dev/fuse fd. A live connection the server
// cannot adopt (`can_adopt` false) is answered with a request for a fresh one, which the agent
// sends on the same socket; `mode` names the server's mode in that request. Errors (the agent
// refused, sent no /dev/fuse, offered a live connection twice) are FAILED_PRECONDITION and were
// answered already where the agent waits for an answer; UNAVAILABLE: the socket failed (the
// agent closed it); ABORTED, unanswered: the live connection offered has ended already (aborted
// before the agent noticed: it mounts a fresh one, which a later attempt gets).
absl::StatusOr<Handoff> ReceiveHandoffBlocking(int sock, const std::string& mode,
                                               const std::function<bool(const Handoff&)>& can_adopt);

// How serving one connection ended: fkserve's exit status, and whether the connection itself
// ended (unmounted, or aborted) rather than the server being stopped or failing.
struct Served {
  int code = 0;
  bool connection_ended = false;
};

// After the connection a server served ended: the volume's next one, on a new handoff
// connection. An abort leaves the volume mounted, and the agent mounts a fresh connection and
// waits on the same socket: the server that is still running takes it at once (a sidecar that
// exited would wait out kubelet's restart back-off, and the pod's reads with it). An unmount
// removes the socket first: NOT_FOUND, the server's work is done. Waits kNextHandoffDelay before
// the first attempt (the agent tears the socket down, or sees the abort, meanwhile), and tries
// again, backing off, while the agent refuses or offers the dead connection, for up to `wait`.
inline constexpr std::chrono::milliseconds kNextHandoffDelay{200};
struct NextHandoff {
  UniqueFd sock;
  Handoff handoff;
};
absl::StatusOr<NextHandoff> ReceiveNextHandoffBlocking(const std::string& path, uid_t agent_uid, const std::string& mode,
                                                       const std::function<bool(const Handoff&)>& can_adopt,
                                                       std::chrono::milliseconds wait);

// Whether the /dev/fuse connection `fuse_fd` has not ended (aborted or unmounted).
bool ConnectionAlive(int fuse_fd);

// Answers the agent's handoff on `sock`; a failure to reply is printed, and changes nothing that
// follows. `relay_state`: the relay's state memfd to deposit with an ok reply (-1: none).
void ReplyToAgent(int sock, bool ok, const std::string& error, bool fresh = false, const std::string& init = "",
                  bool relayed = false, int relay_state = -1);

// Sends `r` (named ServerName()) with up to two fds; a failure is printed with `what`.
void SendToAgent(int sock, HandoffReply r, const char* what, int fd = -1, int fd2 = -1);

}  // namespace fusekeeper
