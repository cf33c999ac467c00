#include "agent/volume/state_store.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/testing/fd_limit_scope.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;

TEST(StateStoreTest, SaveLoadRemoveRoundTrip) {
  ShortTempDir d;
  auto store = StateStore::Open(d.path() + "/state");
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(fs::status(d.path() + "/state/volumes").permissions() & fs::perms::all, fs::perms::owner_all);
  state::Volume v;
  v.set_volume_id(std::string("id with / and \n and \xc3\xbc (u-umlaut)") + std::string(100, 'x'));
  v.set_host_path("/data");
  v.add_targets()->set_path("/k/t");
  ASSERT_TRUE(store->SaveBlocking(v).ok());
  v.set_host_path("/data2");
  ASSERT_TRUE(store->SaveBlocking(v).ok());  // overwrite
  std::vector<std::string> problems;
  auto loaded = store->LoadAllBlocking(&problems);
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->size(), 1u);
  EXPECT_EQ((*loaded)[0].volume_id(), v.volume_id());
  EXPECT_EQ((*loaded)[0].host_path(), "/data2");
  EXPECT_TRUE(problems.empty());
  ASSERT_TRUE(store->RemoveBlocking(v.volume_id()).ok());
  ASSERT_TRUE(store->RemoveBlocking(v.volume_id()).ok()) << "idempotent";
  EXPECT_TRUE(store->LoadAllBlocking(&problems)->empty());
}

TEST(StateStoreTest, CorruptFilesAreMovedAsideAndTempFilesCleaned) {
  ShortTempDir d;
  {
    auto store = StateStore::Open(d.path());
    ASSERT_TRUE(store.ok());
    state::Volume v;
    v.set_volume_id("good");
    ASSERT_TRUE(store->SaveBlocking(v).ok());
  }
  const std::string dir = d.path() + "/volumes";
  { std::ofstream(dir + "/" + Sha256Hex("bad") + ".state") << "\xff\xff garbage"; }
  { std::ofstream(dir + "/x.state.tmp.123.0") << "half-written"; }
  auto store = StateStore::Open(d.path());
  ASSERT_TRUE(store.ok());
  EXPECT_FALSE(fs::exists(dir + "/x.state.tmp.123.0")) << "a killed writer's temp file";
  std::vector<std::string> problems;
  auto loaded = store->LoadAllBlocking(&problems);
  ASSERT_TRUE(loaded.ok());
  ASSERT_EQ(loaded->size(), 1u);
  EXPECT_EQ((*loaded)[0].volume_id(), "good");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_TRUE(fs::exists(dir + "/" + Sha256Hex("bad") + ".state.corrupt"));
}

// A state file that cannot be opened now (the agent out of fds: a node with many volumes under a
// runtime's soft limit) is not a corrupt one: moving it aside forgot a volume that was mounted.
// The load fails, and the file is kept for the next try.
TEST(StateStoreTest, AFileThatCannotBeOpenedNowFailsTheLoadAndIsKept) {
  ShortTempDir d;
  auto store = StateStore::Open(d.path());
  ASSERT_TRUE(store.ok());
  state::Volume v;
  v.set_volume_id("kept");
  ASSERT_TRUE(store->SaveBlocking(v).ok());
  const std::string file = d.path() + "/volumes/" + Sha256Hex("kept") + ".state";
  ASSERT_TRUE(fs::exists(file));
  // One fd to be had: the directory's listing takes it, and the state file's open finds none.
  FdLimitScope one_fd(1);
  ASSERT_TRUE(one_fd.ok());
  std::vector<std::string> problems;
  auto loaded = store->LoadAllBlocking(&problems);
  one_fd.Restore();
  ASSERT_FALSE(loaded.ok()) << "loaded " << loaded->size() << " volume(s) without the one it could not open";
  EXPECT_TRUE(absl::StrContains(loaded.status().message(), "Too many open files")) << loaded.status();
  EXPECT_TRUE(problems.empty());
  EXPECT_TRUE(fs::exists(file)) << "kept, not moved aside";
  EXPECT_FALSE(fs::exists(file + ".corrupt"));
  auto again = store->LoadAllBlocking(&problems);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->size(), 1u);
  EXPECT_EQ((*again)[0].volume_id(), "kept");
}

TEST(StateStoreTest, RejectsRelativeDir) {
  EXPECT_EQ(StateStore::Open("relative").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fusekeeper
