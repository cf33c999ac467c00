// Unix sockets between fkserve's parts and the agent: connecting one, and file descriptors over
// it (SCM_RIGHTS), the one place that builds and reads the control messages. Used by the handoff (agent and fkserve), by fkserve's fusermount (a static
// binary) and by the preload library: libc and UniqueFd only.
#pragma once

#include <stddef.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <string>
#include <vector>

#include "agent/base/unique_fd.h"

namespace fusekeeper {

inline constexpr size_t kMaxPassedFds = 8;

// A SOCK_SEQPACKET socket (close-on-exec) connected to the Unix socket at `path`; invalid with
// errno set if not (ENAMETOOLONG: a path sun_path cannot hold). `nonblocking`: the socket is, and
// a listener whose queue is full refuses at once (EAGAIN) instead of making the caller wait.
UniqueFd ConnectSeqpacket(const std::string& path, bool nonblocking = false);

// Control space for up to kMaxPassedFds fds, aligned for cmsghdr.
struct FdControl {
  alignas(cmsghdr) char bytes[CMSG_SPACE(sizeof(int) * kMaxPassedFds)];
};

// Attaches fds[0..n) (those >= 0; at most kMaxPassedFds) to `msg`, in `control` (which must
// outlive the send). No fd: no control data.
void AttachFds(msghdr* msg, FdControl* control, const int* fds, size_t n);

// Blocking: sends `len` bytes as one message with the fds attached; retries EINTR, never raises
// SIGPIPE. sendmsg's result.
ssize_t SendWithFds(int sock, const void* data, size_t len, const int* fds, size_t n);

// Takes ownership of every fd a received message carried (close-on-exec if received with
// MSG_CMSG_CLOEXEC); *other_control if it carried control data of another kind.
std::vector<UniqueFd> TakeReceivedFds(const msghdr& msg, bool* other_control);

// Blocking: receives one message into buf (retries EINTR, fds close-on-exec). recvmsg's result;
// its fds in *fds (owned, whatever else is wrong), *msg_flags (MSG_TRUNC, MSG_CTRUNC) and
// *other_control as TakeReceivedFds.
ssize_t ReceiveWithFds(int sock, void* buf, size_t len, std::vector<UniqueFd>* fds, int* msg_flags,
                       bool* other_control);

}  // namespace fusekeeper
