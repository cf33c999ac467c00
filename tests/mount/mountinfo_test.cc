#include "agent/mount/mountinfo.h"

#include <fstream>
#include <random>
#include <sstream>

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

TEST(MountInfoTest, ParsesEveryField) {
  auto t = MountTable::Parse(
      "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->entries().size(), 1u);
  const MountEntry& e = t->entries()[0];
  EXPECT_EQ(e.id, 36u);
  EXPECT_EQ(e.parent_id, 35u);
  EXPECT_EQ(e.major, 98u);
  EXPECT_EQ(e.minor, 0u);
  EXPECT_EQ(e.root, "/mnt1");
  EXPECT_EQ(e.mount_point, "/mnt2");
  EXPECT_EQ(e.mount_options, "rw,noatime");
  EXPECT_EQ(e.master, 1u);
  EXPECT_EQ(e.shared, 0u);
  EXPECT_EQ(e.fs_type, "ext3");
  EXPECT_EQ(e.source, "/dev/root");
  EXPECT_EQ(e.super_options, "rw,errors=continue");
  EXPECT_FALSE(e.read_only());
}

TEST(MountInfoTest, OptionalTagsIncludingUnknownOnes) {
  auto t = MountTable::Parse(
      "1 0 0:1 / / ro shared:7 master:3 propagate_from:2 unbindable future:9 - tmpfs none rw\n"
      "2 1 0:2 / /x rw - tmpfs none rw\n");
  ASSERT_TRUE(t.ok()) << t.status();
  const MountEntry& e = t->entries()[0];
  EXPECT_EQ(e.shared, 7u);
  EXPECT_EQ(e.master, 3u);
  EXPECT_EQ(e.propagate_from, 2u);
  EXPECT_TRUE(e.unbindable);
  EXPECT_TRUE(e.read_only());
  EXPECT_EQ(t->entries()[1].shared, 0u);
  EXPECT_FALSE(t->entries()[1].unbindable);
}

TEST(MountInfoTest, UnescapesSpaceTabNewlineAndBackslash) {
  auto t = MountTable::Parse(
      "5 1 0:3 /a\\040b /mnt/with\\040space\\011tab\\012nl\\134bs rw - fuse.x my\\040src rw\n");
  ASSERT_TRUE(t.ok()) << t.status();
  const MountEntry& e = t->entries()[0];
  EXPECT_EQ(e.root, "/a b");
  EXPECT_EQ(e.mount_point, "/mnt/with space\ttab\nnl\\bs");
  EXPECT_EQ(e.source, "my src");
  EXPECT_EQ(EscapeMountField(e.mount_point), "/mnt/with\\040space\\011tab\\012nl\\134bs");
  EXPECT_EQ(UnescapeMountField("trailing\\04"), "trailing\\04");  // incomplete escape kept
}

TEST(MountInfoTest, EmptySourceField) {
  auto t = MountTable::Parse("5 1 0:3 / /m rw - overlay  rw,lowerdir=/a\n");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->entries()[0].source, "");
  EXPECT_EQ(t->entries()[0].super_options, "rw,lowerdir=/a");
}

TEST(MountInfoTest, BadLinesAreErrorsNamingTheLine) {
  const char* good = "1 0 0:1 / / rw - tmpfs none rw\n";
  for (const char* bad : {
           "x 0 0:1 / / rw - tmpfs none rw",      // id
           "1 0 01 / / rw - tmpfs none rw",       // major:minor
           "1 0 0:1 / / rw tmpfs none rw",        // no separator
           "1 0 0:1 / / rw -",                    // truncated after separator
           "1 0 0:1 / / rw - tmpfs",              // no source
           "1 0 0:1 /",                           // truncated
           "1 0 0:1 / / rw shared:x - tmpfs none rw",  // bad tag value
           "99999999999 0 0:1 / / rw - tmpfs none rw",  // overflow
       }) {
    auto t = MountTable::Parse(std::string(good) + bad + "\n");
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("line 2"), std::string::npos) << t.status();
  }
}

TEST(MountInfoTest, RandomGarbageNeverCrashes) {
  std::mt19937 rng(42);
  const std::string alphabet = "0123456789 :-\\/\nabcshared:master:";
  for (int i = 0; i < 20000; ++i) {
    std::string s;
    int n = rng() % 120;
    for (int j = 0; j < n; ++j) s.push_back(alphabet[rng() % alphabet.size()]);
    auto t = MountTable::Parse(s);
    if (t.ok()) {
      for (const auto& e : t->entries()) EXPECT_FALSE(e.fs_type.empty());
    }
  }
}

TEST(MountInfoTest, FindTopPicksTheTopOfAStack) {
  auto t = MountTable::Parse(
      "1 0 0:1 / / rw - tmpfs none rw\n"
      "10 1 0:2 / /m rw - tmpfs a rw\n"
      "11 10 0:3 / /m rw - tmpfs b rw\n"
      "12 11 0:4 / /m rw - tmpfs c rw\n");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->FindAll("/m").size(), 3u);
  ASSERT_NE(t->FindTop("/m"), nullptr);
  EXPECT_EQ(t->FindTop("/m")->source, "c");
  EXPECT_EQ(t->FindTop("/nothing"), nullptr);
  EXPECT_EQ(t->FindById(11)->source, "b");
}

// Found by fuzzing (tests/fuzz/corpus/mountinfo/self-parent-*): a namespace's root mount is its
// own parent, and a malformed table can hold a cycle; neither may hide the mount.
TEST(MountInfoTest, FindTopHandlesSelfParentedRootAndCycles) {
  auto t = MountTable::Parse(
      "1 1 0:1 / / rw - tmpfs none rw\n"
      "7 8 0:2 / /c rw - tmpfs a rw\n"
      "8 7 0:3 / /c rw - tmpfs b rw\n");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_NE(t->FindTop("/"), nullptr);
  EXPECT_EQ(t->FindTop("/")->id, 1u);
  ASSERT_NE(t->FindTop("/c"), nullptr);
  EXPECT_EQ(t->FindTop("/c")->source, "b");
}

TEST(MountInfoTest, ParsesThisMachinesTable) {
  std::ifstream in("/proc/self/mountinfo");
  std::stringstream ss;
  ss << in.rdbuf();
  auto t = MountTable::Parse(ss.str());
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_FALSE(t->entries().empty());
  // Views survive moving the table.
  MountTable moved = std::move(*t);
  EXPECT_FALSE(moved.entries()[0].fs_type.empty());
}

}  // namespace
}  // namespace fusekeeper
