#include "agent/fkserve/relay/program_socket.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fusekeeper::relay {
namespace {

// Asked for each end of a program's socket pair; the kernel caps it at net.core.wmem_max.
constexpr int kSocketBufferBytes = 4 << 20;
// A WRITE of 1 MiB (libfuse3's largest) with its headers: no message needs more.
constexpr size_t kLargestUsefulMessage = (1 << 20) + 4096;

void SizeBuffers(int fd) {
  int bytes = kSocketBufferBytes;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
}

absl::StatusOr<ProgramSocketPair> SizedPair() {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return absl::InternalError(absl::StrCat("socketpair: ", strerror(errno)));
  }
  ProgramSocketPair p{UniqueFd(sv[0]), UniqueFd(sv[1])};
  SizeBuffers(p.ours.get());
  SizeBuffers(p.theirs.get());
  return p;
}

}  // namespace

absl::StatusOr<size_t> LargestProgramMessage() {
  auto probe = SizedPair();
  if (!probe.ok()) return probe.status();
  int sndbuf = 0;
  socklen_t len = sizeof(sndbuf);
  getsockopt(probe->ours.get(), SOL_SOCKET, SO_SNDBUF, &sndbuf, &len);
  if (sndbuf < 64 * 1024) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a socket's send buffer is only ", sndbuf, " bytes here (net.core.wmem_max): too small to relay FUSE"));
  }
  // Less the kernel's own 32 bytes of accounting (unix_dgram_sendmsg), and a margin.
  return std::min<size_t>(static_cast<size_t>(sndbuf) - 32 - 512, kLargestUsefulMessage);
}

absl::StatusOr<ProgramSocketPair> NewProgramSocketPair() {
  auto p = SizedPair();
  if (!p.ok()) return p.status();
  fcntl(p->ours.get(), F_SETFL, O_NONBLOCK);
  return p;
}

}  // namespace fusekeeper::relay
