// FUSE mounts made the agent's way (fd=N, new mount API), served by a libfuse3 server through
// /dev/fd/N, and the things the agent must survive: no server yet, a dead server, abort.
#include "agent/fuse/fuse_mount.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>

#include "absl/strings/match.h"
#include "agent/mount/mount_ops.h"
#include "gtest/gtest.h"
#include "tests/testing/hello_fuse_server.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/mount_fixture.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;

class FuseMountTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access("/dev/fuse", R_OK | W_OK) != 0) GTEST_SKIP() << "no /dev/fuse on this kernel";
    mnt_ = t_.path() + "/mnt";
    fs::create_directories(mnt_);
  }
  // Mounts a fresh connection on mnt_; returns the /dev/fuse fd.
  UniqueFd Mount(FuseMountOptions options = {}) {
    auto dev = OpenFuseDeviceBlocking();
    EXPECT_TRUE(dev.ok()) << dev.status();
    UniqueFd target(open(mnt_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    absl::Status s = MountFuseBlocking(dev->get(), target.get(), mnt_, options);
    EXPECT_TRUE(s.ok()) << s;
    return std::move(*dev);
  }
  const MountEntry* Entry() {
    table_ = std::make_unique<MountTable>(ReadMountTable());
    return table_->FindTop(mnt_);
  }

  TmpfsDir t_;
  std::string mnt_;
  std::unique_ptr<MountTable> table_;
};

TEST_F(FuseMountTest, MountsWithTheRequiredOptions) {
  UniqueFd dev = Mount({.subtype = "fktest", .source = "vol-1", .user_id = 1234, .group_id = 5678});
  const MountEntry* e = Entry();
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->fs_type, "fuse.fktest");
  EXPECT_EQ(e->source, "vol-1");
  EXPECT_EQ(e->major, 0u);
  EXPECT_TRUE(absl::StrContains(e->mount_options, "nosuid")) << e->mount_options;
  EXPECT_TRUE(absl::StrContains(e->mount_options, "nodev")) << e->mount_options;
  EXPECT_FALSE(e->read_only());
  for (const char* opt : {"user_id=1234", "group_id=5678", "allow_other", "default_permissions"}) {
    EXPECT_TRUE(absl::StrContains(e->super_options, opt)) << opt << " in " << e->super_options;
  }
  ASSERT_EQ(umount2(mnt_.c_str(), MNT_DETACH), 0);
}

TEST_F(FuseMountTest, ReadOnlyIsSetBeforeTheMountIsVisible) {
  UniqueFd dev = Mount({.read_only = true});
  ASSERT_NE(Entry(), nullptr);
  EXPECT_TRUE(Entry()->read_only());
  ASSERT_EQ(umount2(mnt_.c_str(), MNT_DETACH), 0);
}

TEST_F(FuseMountTest, ServedThroughDevFdByAnUnchangedLibfuse3Server) {
  UniqueFd dev = Mount();
  {
    HelloFuseServer server(dev.Release(), "hello through /dev/fd/N\n");
    std::string content;
    {
      std::ifstream in(mnt_ + "/hello");
      content.assign((std::istreambuf_iterator<char>(in)), {});
    }
    EXPECT_EQ(content, "hello through /dev/fd/N\n");
    // Unmounting ends the connection, and with it the server's session loop.
    ASSERT_EQ(umount2(mnt_.c_str(), MNT_DETACH), 0) << strerror(errno);
  }
  EXPECT_EQ(MountCountAt(mnt_), 0);
}

// Until a server takes the fd, anything that asks the file system blocks. The agent's own mount
// lookups must not: they use statx(AT_STATX_DONT_SYNC) + statmount.
TEST_F(FuseMountTest, MountLookupDoesNotWaitForAnAbsentServer) {
  UniqueFd dev = Mount({.source = "unserved"});
  auto lookup = std::async(std::launch::async, [&] {
    UniqueFd fd(open(mnt_.c_str(), O_PATH | O_CLOEXEC));
    return LookupMountAtBlocking(fd.get(), mnt_);
  });
  ASSERT_EQ(lookup.wait_for(kTestDeadline), std::future_status::ready) << "lookup hung on FUSE";
  auto facts = lookup.get();
  ASSERT_TRUE(facts.ok()) << facts.status();
  ASSERT_TRUE(facts->has_value());
  // statmount names the type "fuse" (the subtype is a separate field on 6.11+); mountinfo, the
  // fallback, says "fuse.fusekeeper".
  EXPECT_TRUE(absl::StartsWith((*facts)->fs_type, "fuse")) << (*facts)->fs_type;
  ASSERT_EQ(umount2(mnt_.c_str(), MNT_DETACH), 0);
}

TEST_F(FuseMountTest, AbortTurnsHangsIntoENOTCONN) {
  UniqueFd dev = Mount();
  const MountEntry* e = Entry();
  ASSERT_NE(e, nullptr);
  const uint32_t minor = e->minor;
  // A reader stuck on the unserved mount...
  auto stuck = std::async(std::launch::async, [&] {
    struct stat st;
    int r = stat((mnt_ + "/x").c_str(), &st);
    return r == 0 ? 0 : errno;
  });
  EXPECT_EQ(stuck.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout)
      << "expected the stat to wait for a server";
  // ...is released by aborting the connection.
  ASSERT_TRUE(AbortFuseConnectionBlocking(minor).ok());
  ASSERT_EQ(stuck.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(stuck.get(), ENOTCONN);
  struct stat st;
  EXPECT_NE(stat((mnt_ + "/y").c_str(), &st), 0);
  EXPECT_EQ(errno, ENOTCONN);
  ASSERT_EQ(umount2(mnt_.c_str(), 0), 0) << strerror(errno);
  EXPECT_EQ(AbortFuseConnectionBlocking(minor).code(), absl::StatusCode::kNotFound);
}

TEST_F(FuseMountTest, BadSubtypeIsRefused) {
  auto dev = OpenFuseDeviceBlocking();
  ASSERT_TRUE(dev.ok());
  UniqueFd target(open(mnt_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  EXPECT_EQ(MountFuseBlocking(dev->get(), target.get(), mnt_, {.subtype = "x,allow_other"}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MountCountAt(mnt_), 0);
}

}  // namespace
}  // namespace fusekeeper
