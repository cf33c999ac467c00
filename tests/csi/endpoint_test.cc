#include "agent/csi/endpoint.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <fstream>

#include "agent/base/unique_fd.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

TEST(ParseUnixEndpointTest, AcceptsTheUsualForms) {
  EXPECT_EQ(*ParseUnixEndpoint("unix:///csi/csi.sock"), "/csi/csi.sock");
  EXPECT_EQ(*ParseUnixEndpoint("unix:/csi/csi.sock"), "/csi/csi.sock");
  EXPECT_EQ(*ParseUnixEndpoint("/csi/csi.sock"), "/csi/csi.sock");
}

TEST(ParseUnixEndpointTest, RejectsWhatIsNotAnAbsoluteUnixPath) {
  for (const char* bad : {"tcp://127.0.0.1:10000", "unix://relative/csi.sock", "csi.sock", "",
                          "unix:", "dns:///x"}) {
    auto r = ParseUnixEndpoint(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ParseUnixEndpointTest, RejectsPathsTooLongForSunPath) {
  std::string ok = "/" + std::string(kMaxUnixSocketPath - 1, 'a');
  EXPECT_TRUE(ParseUnixEndpoint("unix://" + ok).ok());
  auto r = ParseUnixEndpoint("unix://" + ok + "b");
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("108 bytes"), std::string::npos) << r.status();
}

UniqueFd BindSocket(const std::string& path, bool listen_too) {
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  EXPECT_EQ(bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  if (listen_too) EXPECT_EQ(listen(fd.get(), 1), 0);
  return fd;
}

TEST(PrepareSocketPathTest, NothingThereIsFine) {
  ShortTempDir dir;
  EXPECT_TRUE(PrepareSocketPath(dir.path() + "/csi.sock").ok());
}

TEST(PrepareSocketPathTest, RemovesAStaleSocket) {
  ShortTempDir dir;
  const std::string path = dir.path() + "/csi.sock";
  BindSocket(path, /*listen_too=*/false);  // bound, then closed: nobody answers
  ASSERT_EQ(access(path.c_str(), F_OK), 0);
  EXPECT_TRUE(PrepareSocketPath(path).ok());
  EXPECT_NE(access(path.c_str(), F_OK), 0);
}

TEST(PrepareSocketPathTest, RefusesASocketSomeoneServes) {
  ShortTempDir dir;
  const std::string path = dir.path() + "/csi.sock";
  UniqueFd live = BindSocket(path, /*listen_too=*/true);
  absl::Status s = PrepareSocketPath(path);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("another process is serving"), std::string::npos) << s;
  EXPECT_EQ(access(path.c_str(), F_OK), 0);
}

TEST(PrepareSocketPathTest, LeavesNonSocketsAlone) {
  ShortTempDir dir;
  const std::string file = dir.path() + "/file";
  { std::ofstream(file) << "precious"; }
  absl::Status s = PrepareSocketPath(file);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("not a socket"), std::string::npos) << s;
  EXPECT_EQ(access(file.c_str(), F_OK), 0);

  const std::string link = dir.path() + "/link";
  ASSERT_EQ(symlink(file.c_str(), link.c_str()), 0);
  s = PrepareSocketPath(link);
  EXPECT_NE(s.message().find("symlink"), std::string::npos) << s;
  struct stat st;
  ASSERT_EQ(lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));

  s = PrepareSocketPath(dir.path());
  EXPECT_NE(s.message().find("directory"), std::string::npos) << s;
}

TEST(RemoveSocketIfOursTest, RemovesOnlyTheSameSocket) {
  ShortTempDir dir;
  const std::string path = dir.path() + "/csi.sock";
  BindSocket(path, false);
  auto id = StatSocketFile(path);
  ASSERT_TRUE(id.ok());
  // Someone replaces it with their own socket: not ours any more.
  ASSERT_EQ(unlink(path.c_str()), 0);
  BindSocket(path, false);
  EXPECT_FALSE(RemoveSocketIfOurs(path, *id));
  EXPECT_EQ(access(path.c_str(), F_OK), 0);
  auto id2 = StatSocketFile(path);
  ASSERT_TRUE(id2.ok());
  EXPECT_TRUE(RemoveSocketIfOurs(path, *id2));
  EXPECT_NE(access(path.c_str(), F_OK), 0);
}

}  // namespace
}  // namespace fusekeeper
