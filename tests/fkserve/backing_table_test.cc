#include "agent/fkserve/backing_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "agent/base/unique_fd.h"
#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

UniqueFd Dup(int fd) { return UniqueFd(fcntl(fd, F_DUPFD_CLOEXEC, 3)); }

TEST(BackingTableTest, AnIdIsClosedWithTheLastHandleNamingIt) {
  auto t = BackingTable::Create();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->IdOf(10), 0);
  ASSERT_TRUE((*t)->Add(0x100000001, 10, 7));
  ASSERT_TRUE((*t)->Add(0x100000002, 10, 7));
  ASSERT_TRUE((*t)->Add(0x100000003, 11, 8));
  EXPECT_EQ((*t)->IdOf(10), 7);
  EXPECT_EQ((*t)->IdOf(11), 8);
  EXPECT_FALSE((*t)->Add(0x100000001, 12, 9)) << "a handle is recorded once";
  EXPECT_EQ((*t)->Remove(0x100000001), 0) << "another handle still names id 7";
  EXPECT_EQ((*t)->IdOf(10), 7);
  EXPECT_EQ((*t)->Remove(0x100000002), 7);
  EXPECT_EQ((*t)->IdOf(10), 0);
  EXPECT_EQ((*t)->Remove(0x100000002), 0) << "released twice";
  EXPECT_EQ((*t)->Remove(0xdead), 0) << "a handle that never passed through";
  EXPECT_EQ((*t)->handles(), 1u);
  EXPECT_EQ((*t)->ids(), 1u);
}

// A successor adopts the memfd: it knows the ids of the handles its predecessor left open and
// releases them as the kernel does, whichever server opened them.
TEST(BackingTableTest, ASuccessorAdoptsWhatItsPredecessorLeftOpen) {
  auto first = BackingTable::Create();
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->Add(0x100000001, 10, 7));
  ASSERT_TRUE((*first)->Add(0x100000002, 11, 8));
  ASSERT_TRUE((*first)->Add(0x100000003, 12, 9));
  EXPECT_EQ((*first)->Remove(0x100000003), 9);
  UniqueFd deposited = Dup((*first)->fd());
  first->reset();  // the first server is gone
  auto second = BackingTable::Adopt(std::move(deposited));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->IdOf(10), 7);
  EXPECT_EQ((*second)->IdOf(11), 8);
  EXPECT_EQ((*second)->IdOf(12), 0) << "released before the handover";
  ASSERT_TRUE((*second)->Add(0x200000001, 10, 7));  // its own open of the same inode
  EXPECT_EQ((*second)->Remove(0x100000001), 0);
  EXPECT_EQ((*second)->Remove(0x200000001), 7);
  // And a third one sees the second's changes.
  auto third = BackingTable::Adopt(Dup((*second)->fd()));
  ASSERT_TRUE(third.ok());
  EXPECT_EQ((*third)->IdOf(10), 0);
  EXPECT_EQ((*third)->IdOf(11), 8);
  EXPECT_EQ((*third)->handles(), 1u);
}

// A server killed between writing a slot's fields and its flag leaves a slot that does not count.
TEST(BackingTableTest, OnlyWholeSlotsCount) {
  auto t = BackingTable::Create(4);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Add(1, 10, 7));
  ASSERT_TRUE((*t)->Add(2, 11, 8));
  EXPECT_EQ((*t)->Remove(2), 8);
  // Slot 1: fields of a new handle written, the flag not yet (as a kill would leave it).
  struct {
    uint64_t fh, nodeid;
    int32_t id;
    uint32_t used;
  } half{3, 12, 9, 0}, no_id{4, 13, -1, 1};
  ASSERT_EQ(pwrite((*t)->fd(), &half, sizeof(half), 64 + 24), 24);
  ASSERT_EQ(pwrite((*t)->fd(), &no_id, sizeof(no_id), 64 + 48), 24);
  auto adopted = BackingTable::Adopt(Dup((*t)->fd()));
  ASSERT_TRUE(adopted.ok());
  EXPECT_EQ((*adopted)->IdOf(12), 0);
  EXPECT_EQ((*adopted)->IdOf(13), 0) << "a slot naming no valid id is dropped";
  EXPECT_FALSE((*adopted)->HasCachedOpens(13));
  EXPECT_EQ((*adopted)->IdOf(10), 7);
  EXPECT_EQ((*adopted)->handles(), 1u);
  // Its room is used again.
  EXPECT_TRUE((*adopted)->Add(5, 14, 10));
  EXPECT_TRUE((*adopted)->Add(6, 15, 11));
  EXPECT_TRUE((*adopted)->Add(7, 16, 12));
  EXPECT_FALSE((*adopted)->Add(8, 17, 13)) << "four slots";
  EXPECT_EQ((*adopted)->Remove(5), 10);
  EXPECT_TRUE((*adopted)->Add(8, 17, 13)) << "room again";
}

// Files open the ordinary way (the agent was away, or refused) are recorded too, so that no open
// of their inode passes through while they are (the kernel: EIO), by this server or the next.
TEST(BackingTableTest, CachedOpensAreKeptUntilTheirLastRelease) {
  auto t = BackingTable::Create();
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Add(1, 10, BackingTable::kCached));
  ASSERT_TRUE((*t)->Add(2, 10, BackingTable::kCached));
  EXPECT_TRUE((*t)->HasCachedOpens(10));
  EXPECT_EQ((*t)->IdOf(10), 0);
  EXPECT_FALSE((*t)->Add(3, 11, -1)) << "not an id";
  EXPECT_EQ((*t)->Remove(1), 0);
  auto next = BackingTable::Adopt(Dup((*t)->fd()));
  ASSERT_TRUE(next.ok());
  EXPECT_TRUE((*next)->HasCachedOpens(10)) << "the successor knows";
  EXPECT_EQ((*next)->Remove(2), 0) << "nothing to close";
  EXPECT_FALSE((*next)->HasCachedOpens(10));
  EXPECT_EQ((*next)->handles(), 0u);
}

TEST(BackingTableTest, AdoptRefusesWhatIsNotATable) {
  // Another kind of state (a relay's journal starts "FKRELAY1").
  UniqueFd other(memfd_create("other", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(write(other.get(), "FKRELAY1", 8), 8);
  auto r = BackingTable::Adopt(std::move(other));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no table header"), std::string::npos) << r.status();
  // A table that could shrink under its users.
  auto t = BackingTable::Create(4);
  ASSERT_TRUE(t.ok());
  UniqueFd unsealed(memfd_create("unsealed", MFD_CLOEXEC));
  char bytes[64 + 4 * 24];
  ASSERT_EQ(pread((*t)->fd(), bytes, sizeof(bytes), 0), static_cast<ssize_t>(sizeof(bytes)));
  ASSERT_EQ(write(unsealed.get(), bytes, sizeof(bytes)), static_cast<ssize_t>(sizeof(bytes)));
  r = BackingTable::Adopt(std::move(unsealed));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("shrunk"), std::string::npos) << r.status();
  // A header whose capacity does not fit the size.
  UniqueFd wrong(memfd_create("wrong", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(write(wrong.get(), bytes, 64), 64);
  r = BackingTable::Adopt(std::move(wrong));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("does not fit"), std::string::npos) << r.status();
  EXPECT_FALSE(BackingTable::Create(0).ok());
}

}  // namespace
}  // namespace fusekeeper
