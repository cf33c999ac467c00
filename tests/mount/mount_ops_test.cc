#include "agent/mount/mount_ops.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include <fstream>

#include "agent/sys/syscalls.h"
#include "gtest/gtest.h"
#include "tests/testing/mount_fixture.h"

namespace fusekeeper {
namespace {

UniqueFd OpenPath(const std::string& p) { return UniqueFd(open(p.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC)); }

TEST(SyscallsTest, StatmountAgreesWithMountinfo) {
  if (!sys::HaveStatmount()) GTEST_SKIP() << "kernel lacks statmount (6.8+)";
  TmpfsDir t;
  uint64_t id = 0;
  ASSERT_EQ(sys::StatxUniqueMountId(AT_FDCWD, t.path().c_str(), &id), 0) << strerror(errno);
  sys::MountFacts facts;
  ASSERT_EQ(sys::StatMount(id, &facts), 0) << strerror(errno);
  EXPECT_EQ(facts.mount_point, t.path());
  EXPECT_EQ(facts.fs_type, "tmpfs");
  EXPECT_EQ(facts.root, "/");
  MountTable table = ReadMountTable();
  const MountEntry* e = table.FindTop(t.path());
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(facts.old_id, e->id);
}

TEST(MountOpsTest, BindReadOnlyThenUnmount) {
  TmpfsDir t;
  const std::string src = t.path() + "/src", dst = t.path() + "/dst";
  ASSERT_EQ(mkdir(src.c_str(), 0755), 0);
  ASSERT_EQ(mkdir(dst.c_str(), 0755), 0);
  { std::ofstream(src + "/hello") << "world"; }
  UniqueFd s = OpenPath(src), d = OpenPath(dst);
  ASSERT_TRUE(BindMountFdBlocking(s.get(), d.get(), {.read_only = true}, src, dst).ok());
  std::ifstream in(dst + "/hello");
  std::string word;
  in >> word;
  EXPECT_EQ(word, "world");
  // Read-only from its first instant.
  EXPECT_LT(open((dst + "/new").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644), 0);
  EXPECT_EQ(errno, EROFS);

  {
    UniqueFd top = OpenPath(dst);
    auto facts = LookupMountAtBlocking(top.get(), dst);
    ASSERT_TRUE(facts.ok()) << facts.status();
    ASSERT_TRUE(facts->has_value());
    EXPECT_TRUE((*facts)->attr & MOUNT_ATTR_RDONLY);
    EXPECT_EQ((*facts)->root, "/src");
  }
  UniqueFd parent = OpenPath(t.path());
  EXPECT_TRUE(UnmountAtBlocking(parent.get(), "dst", dst, /*busy_retries=*/0).ok())
      << "a plain unmount, not a lazy detach: nothing holds it";
  EXPECT_EQ(MountCountAt(dst), 0);
  UniqueFd again = OpenPath(dst);
  auto none = LookupMountAtBlocking(again.get(), dst);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  EXPECT_EQ(UnmountAtBlocking(parent.get(), "dst", dst).code(), absl::StatusCode::kNotFound);
}

TEST(MountOpsTest, BusyMountIsDetached) {
  TmpfsDir t;
  const std::string dst = t.path() + "/dst";
  ASSERT_EQ(mkdir(dst.c_str(), 0755), 0);
  ASSERT_EQ(mount("tmpfs", dst.c_str(), "tmpfs", 0, nullptr), 0);
  UniqueFd busy(open((dst + "/f").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644));  // keeps it busy
  ASSERT_TRUE(busy.valid());
  UniqueFd parent = OpenPath(t.path());
  EXPECT_TRUE(UnmountAtBlocking(parent.get(), "dst", dst).ok());
  EXPECT_EQ(MountCountAt(dst), 0) << "detached lazily";
}

TEST(MountOpsTest, UnmountNeverFollowsASymlink) {
  TmpfsDir t;
  const std::string real = t.path() + "/real", link = t.path() + "/link";
  ASSERT_EQ(mkdir(real.c_str(), 0755), 0);
  ASSERT_EQ(mount("tmpfs", real.c_str(), "tmpfs", 0, nullptr), 0);
  ASSERT_EQ(symlink(real.c_str(), link.c_str()), 0);
  UniqueFd parent = OpenPath(t.path());
  EXPECT_FALSE(UnmountAtBlocking(parent.get(), "link", link).ok());
  EXPECT_EQ(MountCountAt(real), 1) << "the mount behind the symlink is untouched";
  umount2(real.c_str(), MNT_DETACH);
}

TEST(MountOpsTest, RemountReadOnlyAndBack) {
  TmpfsDir t;
  const std::string dst = t.path() + "/dst";
  ASSERT_EQ(mkdir(dst.c_str(), 0755), 0);
  ASSERT_EQ(mount("tmpfs", dst.c_str(), "tmpfs", 0, nullptr), 0);
  UniqueFd fd = OpenPath(dst);
  ASSERT_TRUE(SetReadOnlyFdBlocking(fd.get(), true, dst).ok());
  EXPECT_TRUE(ReadMountTable().FindTop(dst)->read_only());
  EXPECT_LT(open((dst + "/f").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644), 0);
  ASSERT_TRUE(SetReadOnlyFdBlocking(fd.get(), false, dst).ok());
  EXPECT_FALSE(ReadMountTable().FindTop(dst)->read_only());
  fd.Reset();
  umount2(dst.c_str(), MNT_DETACH);
}

TEST(MountOpsTest, PropagationChanges) {
  TmpfsDir t;
  const std::string dst = t.path() + "/dst";
  ASSERT_EQ(mkdir(dst.c_str(), 0755), 0);
  ASSERT_EQ(mount("tmpfs", dst.c_str(), "tmpfs", 0, nullptr), 0);
  UniqueFd fd = OpenPath(dst);
  ASSERT_TRUE(SetPropagationFdBlocking(fd.get(), MS_SHARED, dst).ok());
  EXPECT_NE(ReadMountTable().FindTop(dst)->shared, 0u);
  ASSERT_TRUE(SetPropagationFdBlocking(fd.get(), MS_PRIVATE, dst).ok());
  EXPECT_EQ(ReadMountTable().FindTop(dst)->shared, 0u);
  umount2(dst.c_str(), MNT_DETACH);
}

}  // namespace
}  // namespace fusekeeper
