#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <fstream>

#include "agent/paths/host_path.h"
#include "agent/paths/kubelet_dir.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

TEST(KubeletDirTest, RelativeAcceptsOnlyNormalisedPathsBelowIt) {
  ShortTempDir d;
  auto k = KubeletDir::Open(d.path());
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(*k->Relative(d.path() + "/pods/u/volumes/x/mount", "target_path"), "pods/u/volumes/x/mount");
  for (std::string bad : {d.path(), d.path() + "/", d.path() + "/pods/../../etc",
                          d.path() + "/./pods", d.path() + "//pods", d.path() + "x/pods",
                          std::string("/etc/passwd"), std::string("relative/x"), d.path() + "/a/.."}) {
    auto r = k->Relative(bad, "target_path");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("target_path"), std::string::npos);
  }
}

TEST(KubeletDirTest, SymlinksBelowTheKubeletDirAreRefused) {
  ShortTempDir d, outside;
  auto k = KubeletDir::Open(d.path());
  ASSERT_TRUE(k.ok());
  ASSERT_EQ(mkdir((d.path() + "/pods").c_str(), 0755), 0);
  // A symlinked directory pointing out of the kubelet dir, and a symlinked leaf.
  ASSERT_EQ(symlink(outside.path().c_str(), (d.path() + "/pods/evil").c_str()), 0);
  ASSERT_EQ(symlink("/etc", (d.path() + "/pods/leaf").c_str()), 0);
  auto parent = k->OpenParentBlocking("pods/evil/mount");
  EXPECT_EQ(parent.status().code(), absl::StatusCode::kInvalidArgument) << parent.status();
  auto leaf = k->OpenPathBlocking("pods/leaf");
  EXPECT_EQ(leaf.status().code(), absl::StatusCode::kInvalidArgument) << leaf.status();
  auto ok = k->OpenParentBlocking("pods/mount");
  EXPECT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(k->OpenPathBlocking("pods/missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(HostPathTest, ParseTypes) {
  for (const char* t : {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket",
                        "CharDevice", "BlockDevice"}) {
    auto p = ParseHostPathType(t);
    ASSERT_TRUE(p.ok()) << t;
    EXPECT_EQ(HostPathTypeName(*p), t);
  }
  EXPECT_EQ(ParseHostPathType("directory").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HostPathTest, IsAtOrBelowMatchesWholeComponents) {
  EXPECT_TRUE(IsAtOrBelow("/data", "/data"));
  EXPECT_TRUE(IsAtOrBelow("/data/x/y", "/data"));
  EXPECT_FALSE(IsAtOrBelow("/database", "/data"));
  EXPECT_FALSE(IsAtOrBelow("/dat", "/data"));
  EXPECT_TRUE(IsAtOrBelow("/anything", "/"));
}

TEST(HostPathTest, RejectsDotDotAndRelativePaths) {
  EXPECT_EQ(ValidateHostPath("/data/../etc").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateHostPath("data").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateHostPath("/data//x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateHostPath("/data/x").ok());
  auto r = OpenHostPathBlocking("/tmp/../etc", HostPathType::kDirectory);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(".."), std::string::npos);
}

class HostPathTypesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = d_.path() + "/dir";
    file_ = d_.path() + "/file";
    sock_ = d_.path() + "/sock";
    chr_ = d_.path() + "/chr";
    blk_ = d_.path() + "/blk";
    link_ = d_.path() + "/link";
    ASSERT_EQ(mkdir(dir_.c_str(), 0700), 0);
    { std::ofstream(file_) << "x"; }
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    strncpy(a.sun_path, sock_.c_str(), sizeof(a.sun_path) - 1);
    ASSERT_EQ(bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    close(s);
    ASSERT_EQ(mknod(chr_.c_str(), S_IFCHR | 0600, makedev(1, 3)), 0);  // like /dev/null
    ASSERT_EQ(mknod(blk_.c_str(), S_IFBLK | 0600, makedev(7, 0)), 0);  // like /dev/loop0
    ASSERT_EQ(symlink(dir_.c_str(), link_.c_str()), 0);
  }
  ShortTempDir d_;
  std::string dir_, file_, sock_, chr_, blk_, link_;
};

TEST_F(HostPathTypesTest, EachTypeAcceptsItsKindAndRejectsTheOthers) {
  struct Row {
    HostPathType type;
    std::string good;
  };
  std::vector<Row> rows = {{HostPathType::kDirectory, dir_}, {HostPathType::kFile, file_},
                           {HostPathType::kSocket, sock_},   {HostPathType::kCharDevice, chr_},
                           {HostPathType::kBlockDevice, blk_}};
  for (const Row& row : rows) {
    auto ok = OpenHostPathBlocking(row.good, row.type);
    ASSERT_TRUE(ok.ok()) << HostPathTypeName(row.type) << ": " << ok.status();
    EXPECT_EQ(ok->is_directory, row.type == HostPathType::kDirectory);
    for (const Row& other : rows) {
      if (other.good == row.good) continue;
      auto bad = OpenHostPathBlocking(other.good, row.type);
      ASSERT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition)
          << HostPathTypeName(row.type) << " on " << other.good;
      EXPECT_NE(bad.status().message().find(std::string("expects")), std::string::npos);
    }
    // Unset type accepts anything that exists.
    EXPECT_TRUE(OpenHostPathBlocking(row.good, HostPathType::kUnset).ok());
  }
  const absl::Status status = OpenHostPathBlocking(file_, HostPathType::kDirectory).status();
  const absl::string_view msg = status.message();
  EXPECT_NE(msg.find("is a regular file, but type Directory expects a directory"), std::string::npos) << msg;
}

TEST_F(HostPathTypesTest, SymlinksAreNotFollowed) {
  auto r = OpenHostPathBlocking(link_, HostPathType::kDirectory);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("symlink"), std::string::npos);
}

TEST_F(HostPathTypesTest, OrCreateCreatesWithKubeletModesThenChecks) {
  const std::string newdir = d_.path() + "/a/b/c";
  auto r = OpenHostPathBlocking(newdir, HostPathType::kDirectoryOrCreate);
  ASSERT_TRUE(r.ok()) << r.status();
  struct stat st;
  ASSERT_EQ(stat(newdir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0755u);
  const std::string newfile = d_.path() + "/x/y/file";
  auto f = OpenHostPathBlocking(newfile, HostPathType::kFileOrCreate);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(stat(newfile.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  // Existing content is left alone.
  EXPECT_TRUE(OpenHostPathBlocking(file_, HostPathType::kFileOrCreate).ok());
  std::ifstream in(file_);
  std::string c;
  in >> c;
  EXPECT_EQ(c, "x");
  // OrCreate still checks: a directory where a file is wanted.
  EXPECT_EQ(OpenHostPathBlocking(dir_, HostPathType::kFileOrCreate).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(OpenHostPathBlocking(d_.path() + "/nope", HostPathType::kDirectory).status().code(),
            absl::StatusCode::kNotFound);
}

// The agent in its container sees the node's root at --host_root: host paths resolve and are
// created beneath it, never in the container's own root, and no symlink leads out of it.
TEST(HostRootTest, PathsResolveAndAreCreatedBeneathTheHostRoot) {
  ShortTempDir host;  // stands in for the node's "/" as the container sees it (/host)
  // DirectoryOrCreate: created on the "node", not in the agent's root.
  auto dir = OpenHostPathBlocking("/srv/data/x", HostPathType::kDirectoryOrCreate, false, host.path());
  ASSERT_TRUE(dir.ok()) << dir.status();
  struct stat st;
  EXPECT_EQ(stat((host.path() + "/srv/data/x").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_NE(stat("/srv/data/x", &st), 0) << "created in the agent's own root";
  // FileOrCreate too.
  ASSERT_TRUE(OpenHostPathBlocking("/srv/f", HostPathType::kFileOrCreate, false, host.path()).ok());
  EXPECT_EQ(stat((host.path() + "/srv/f").c_str(), &st), 0);
  // The node's absolute symlinks resolve on the node: /srv/link -> /etc means <host>/etc.
  ASSERT_EQ(symlink("/etc", (host.path() + "/srv/link").c_str()), 0);
  auto through = OpenHostPathBlocking("/srv/link/passwd", HostPathType::kFile, false, host.path());
  EXPECT_EQ(through.status().code(), absl::StatusCode::kNotFound)
      << "resolved into the agent's /etc instead of the node's: " << through.status();
  mkdir((host.path() + "/etc").c_str(), 0755);
  { std::ofstream(host.path() + "/etc/passwd") << "node's"; }
  through = OpenHostPathBlocking("/srv/link/passwd", HostPathType::kFile, false, host.path());
  ASSERT_TRUE(through.ok()) << through.status();
  auto real = RealPathOfFd(through->fd.get());
  ASSERT_TRUE(real.ok());
  EXPECT_EQ(*real, host.path() + "/etc/passwd");
  // A pod author's path is created through no symlink (where an opened one led is checked by the
  // caller against its allowed prefixes, with the real path as above).
  EXPECT_EQ(OpenHostPathBlocking("/srv/link/new", HostPathType::kDirectoryOrCreate, true, host.path()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(HostRootTest, AnOverlayRootWithoutAHostRootIsNamedAsAContainerRoot) {
  // This test's own root is the node's (not an overlay): nothing to say.
  struct statfs sf{};
  ASSERT_EQ(statfs("/", &sf), 0);
  if (static_cast<long>(sf.f_type) == 0x794c7630) GTEST_SKIP() << "this test itself runs in an overlay root";
  EXPECT_EQ(ContainerRootProblem(""), "");
  EXPECT_EQ(ContainerRootProblem("/host"), "");
}

}  // namespace
}  // namespace fusekeeper
