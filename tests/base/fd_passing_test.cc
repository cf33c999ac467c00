// SCM_RIGHTS over a real socket pair: fds arrive open, close-on-exec and owned; what is wrong
// with a message (truncated, more fds than room) is said, and nothing leaks.
#include "agent/base/fd_passing.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

struct Pair {
  UniqueFd a, b;
  Pair() {
    int sv[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    a.Reset(sv[0]);
    b.Reset(sv[1]);
  }
};

ino_t Inode(int fd) {
  struct stat st {};
  fstat(fd, &st);
  return st.st_ino;
}

TEST(FdPassingTest, TwoFdsAndTheBytesArriveOpenCloseOnExecAndOwned) {
  Pair p;
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, 0), 0);
  UniqueFd r(pipe_fds[0]), w(pipe_fds[1]);
  const int fds[3] = {r.get(), -1, w.get()};  // a -1 is skipped
  ASSERT_EQ(SendWithFds(p.a.get(), "hello", 5, fds, 3), 5);
  char buf[16];
  std::vector<UniqueFd> got;
  int flags = -1;
  bool other = true;
  ASSERT_EQ(ReceiveWithFds(p.b.get(), buf, sizeof(buf), &got, &flags, &other), 5);
  EXPECT_EQ(std::string(buf, 5), "hello");
  EXPECT_EQ(flags & (MSG_TRUNC | MSG_CTRUNC), 0);
  EXPECT_FALSE(other);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(Inode(got[0].get()), Inode(r.get()));
  EXPECT_EQ(Inode(got[1].get()), Inode(w.get()));
  for (const UniqueFd& f : got) EXPECT_EQ(fcntl(f.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
}

TEST(FdPassingTest, NoFdMeansNoControlDataAndATruncatedMessageSaysSo) {
  Pair p;
  ASSERT_EQ(SendWithFds(p.a.get(), "0123456789", 10, nullptr, 0), 10);
  char buf[4];
  std::vector<UniqueFd> got;
  int flags = 0;
  bool other = true;
  ASSERT_EQ(ReceiveWithFds(p.b.get(), buf, sizeof(buf), &got, &flags, &other), 4);
  EXPECT_NE(flags & MSG_TRUNC, 0);
  EXPECT_TRUE(got.empty());
  EXPECT_FALSE(other);
}

TEST(FdPassingTest, MoreFdsThanTheRoomAreRefusedAtTheSenderSide) {
  // At most kMaxPassedFds are attached: the rest are not sent (the receiver's room is as large).
  Pair p;
  std::vector<UniqueFd> opened;
  std::vector<int> fds;
  for (size_t i = 0; i < kMaxPassedFds + 3; ++i) {
    opened.emplace_back(open("/dev/null", O_RDONLY | O_CLOEXEC));
    fds.push_back(opened.back().get());
  }
  ASSERT_EQ(SendWithFds(p.a.get(), "x", 1, fds.data(), fds.size()), 1);
  char buf[4];
  std::vector<UniqueFd> got;
  int flags = 0;
  bool other = false;
  ASSERT_EQ(ReceiveWithFds(p.b.get(), buf, sizeof(buf), &got, &flags, &other), 1);
  EXPECT_EQ(got.size(), kMaxPassedFds);
  EXPECT_EQ(flags & MSG_CTRUNC, 0);
}

TEST(FdPassingTest, ConnectSeqpacketReachesAListenerAndSaysWhyNot) {
  char dir_templ[] = "/tmp/fk-fdpass-XXXXXX";
  ASSERT_NE(mkdtemp(dir_templ), nullptr);
  const std::string path = std::string(dir_templ) + "/s";
  UniqueFd missing = ConnectSeqpacket(path);
  EXPECT_FALSE(missing.valid());
  EXPECT_EQ(errno, ENOENT);
  UniqueFd listener(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  memcpy(addr.sun_path, path.data(), path.size());
  ASSERT_EQ(bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener.get(), 1), 0);
  UniqueFd c = ConnectSeqpacket(path);
  ASSERT_TRUE(c.valid()) << strerror(errno);
  EXPECT_EQ(fcntl(c.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  UniqueFd too_long = ConnectSeqpacket(std::string(200, 'x'));
  EXPECT_FALSE(too_long.valid());
  EXPECT_EQ(errno, ENAMETOOLONG);
  unlink(path.c_str());
  rmdir(dir_templ);
}

}  // namespace
}  // namespace fusekeeper
