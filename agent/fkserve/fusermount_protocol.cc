#include "agent/fkserve/fusermount_protocol.h"

#include <vector>

#include "agent/base/fd_passing.h"

namespace fusekeeper {

bool SendWithFd(int sock, const std::string& text, int fd) {
  return SendWithFds(sock, text.data(), text.size(), &fd, 1) == static_cast<ssize_t>(text.size());
}

bool ReceiveWithFd(int sock, std::string* text, int* fd) {
  char buf[8192];
  std::vector<UniqueFd> fds;
  int flags = 0;
  bool other_control = false;
  const ssize_t n = ReceiveWithFds(sock, buf, sizeof(buf), &fds, &flags, &other_control);
  *fd = -1;
  if (n < 0) return false;
  // One fd is the protocol's: any other that came along is closed.
  if (!fds.empty()) *fd = fds[0].Release();
  text->assign(buf, static_cast<size_t>(n));
  return true;
}

}  // namespace fusekeeper
