#include "agent/base/fd_passing.h"

#include <errno.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/un.h>

namespace fusekeeper {

UniqueFd ConnectSeqpacket(const std::string& path, bool nonblocking) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    errno = ENAMETOOLONG;
    return UniqueFd();
  }
  memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0));
  if (!s.valid()) return s;
  if (connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    s.Reset();
    errno = err;
  }
  return s;
}

void AttachFds(msghdr* msg, FdControl* control, const int* fds, size_t n) {
  int kept[kMaxPassedFds];
  size_t count = 0;
  for (size_t i = 0; i < n && count < kMaxPassedFds; ++i) {
    if (fds[i] >= 0) kept[count++] = fds[i];
  }
  if (count == 0) {
    msg->msg_control = nullptr;
    msg->msg_controllen = 0;
    return;
  }
  memset(control->bytes, 0, sizeof(control->bytes));
  msg->msg_control = control->bytes;
  msg->msg_controllen = CMSG_SPACE(count * sizeof(int));
  cmsghdr* c = CMSG_FIRSTHDR(msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(count * sizeof(int));
  memcpy(CMSG_DATA(c), kept, count * sizeof(int));
}

ssize_t SendWithFds(int sock, const void* data, size_t len, const int* fds, size_t n) {
  iovec iov{const_cast<void*>(data), len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  FdControl control;
  AttachFds(&msg, &control, fds, n);
  ssize_t sent;
  do {
    sent = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  return sent;
}

std::vector<UniqueFd> TakeReceivedFds(const msghdr& msg, bool* other_control) {
  std::vector<UniqueFd> fds;
  *other_control = false;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(const_cast<msghdr*>(&msg), c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds.emplace_back(fd);
      }
    } else {
      *other_control = true;
    }
  }
  return fds;
}

ssize_t ReceiveWithFds(int sock, void* buf, size_t len, std::vector<UniqueFd>* fds, int* msg_flags,
                       bool* other_control) {
  iovec iov{buf, len};
  FdControl control;
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.bytes;
  msg.msg_controllen = sizeof(control.bytes);
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  *other_control = false;
  *msg_flags = 0;
  fds->clear();
  if (n < 0) return n;
  *fds = TakeReceivedFds(msg, other_control);
  *msg_flags = msg.msg_flags;
  return n;
}

}  // namespace fusekeeper
