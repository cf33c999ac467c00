#include "agent/volume/reconcile.h"

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

std::string Same(const std::string& p) { return p; }

state::Volume Vol(const std::string& id) {
  state::Volume v;
  v.set_volume_id(id);
  v.set_is_directory(true);
  v.set_source_dev_major(8);
  v.set_source_dev_minor(1);
  return v;
}

MountTable Table(const std::string& text) {
  auto t = MountTable::Parse("1 0 0:1 / / rw - tmpfs none rw\n" + text);
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

TEST(ReconcileTest, PendingStagingIsAdoptedWhenMountedAndForgottenOtherwise) {
  state::Volume a = Vol("a");
  a.set_staging_path("/k/a");
  a.set_staging_pending(true);
  state::Volume b = Vol("b");
  b.set_staging_path("/k/b");
  b.set_staging_pending(true);
  auto out = Reconcile({a, b}, Table("10 1 8:1 /data /k/a rw - ext4 /dev/sda1 rw\n"), Same);
  ASSERT_EQ(out.volumes.size(), 1u);
  EXPECT_EQ(out.volumes[0].volume_id(), "a");
  EXPECT_FALSE(out.volumes[0].staging_pending());
  EXPECT_EQ(out.volumes[0].staging_mount().root(), "/data");
  EXPECT_EQ(out.save.size(), 1u);
  EXPECT_EQ(out.remove, std::vector<std::string>{"b"});
}

TEST(ReconcileTest, PendingStagingOnAForeignDeviceIsNotAdopted) {
  state::Volume a = Vol("a");
  a.set_staging_path("/k/a");
  a.set_staging_pending(true);
  auto out = Reconcile({a}, Table("10 1 0:99 / /k/a rw - tmpfs x rw\n"), Same);
  EXPECT_TRUE(out.volumes.empty());
  EXPECT_EQ(out.remove, std::vector<std::string>{"a"});
}

TEST(ReconcileTest, TargetsWhoseMountsAreGoneAreDroppedCompletedOnesKept) {
  state::Volume v = Vol("v");
  v.set_staging_path("/k/s");
  v.mutable_staging_mount()->set_dev_major(8);
  v.mutable_staging_mount()->set_dev_minor(1);
  v.mutable_staging_mount()->set_root("/data");
  for (const char* p : {"/k/t1", "/k/t2"}) {
    auto* t = v.add_targets();
    t->set_path(p);
    t->mutable_mount()->set_dev_major(8);
    t->mutable_mount()->set_dev_minor(1);
    t->mutable_mount()->set_root("/data");
  }
  auto* pending = v.add_targets();
  pending->set_path("/k/t3");
  pending->set_pending(true);
  auto out = Reconcile({v},
                       Table("10 1 8:1 /data /k/s rw - ext4 d rw\n"
                             "11 1 8:1 /data /k/t1 rw - ext4 d rw\n"
                             "12 1 8:1 /data /k/t3 rw - ext4 d rw\n"),
                       Same);
  ASSERT_EQ(out.volumes.size(), 1u);
  const auto& got = out.volumes[0];
  ASSERT_EQ(got.targets_size(), 2);
  EXPECT_EQ(got.targets(0).path(), "/k/t1");
  EXPECT_EQ(got.targets(1).path(), "/k/t3");
  EXPECT_FALSE(got.targets(1).pending()) << "adopted";
  EXPECT_EQ(out.save.size(), 1u);
}

TEST(ReconcileTest, PathsAreMappedToWhatTheMountTableShows) {
  state::Volume v = Vol("v");
  v.set_staging_path("/var/lib/kubelet/s");
  v.set_staging_pending(true);
  auto out = Reconcile({v}, Table("10 1 8:1 /data /data/kubelet/s rw - ext4 d rw\n"),
                       [](const std::string& p) { return "/data/kubelet" + p.substr(16); });
  ASSERT_EQ(out.volumes.size(), 1u);
  EXPECT_FALSE(out.volumes[0].staging_pending());
}

TEST(ReconcileTest, UnchangedVolumesAreNotRewritten) {
  state::Volume v = Vol("v");
  v.set_staging_path("/k/s");
  v.mutable_staging_mount()->set_dev_major(8);
  v.mutable_staging_mount()->set_dev_minor(1);
  v.mutable_staging_mount()->set_root("/data");
  auto out = Reconcile({v}, Table("10 1 8:1 /data /k/s rw - ext4 d rw\n"), Same);
  EXPECT_EQ(out.volumes.size(), 1u);
  EXPECT_TRUE(out.save.empty());
  EXPECT_TRUE(out.remove.empty());
}

TEST(ReconcileTest, FuseTargetsReBoundOrStaleAfterACrashedRecoveryAreKept) {
  // A FUSE volume whose global mount was replaced (0:60 → 0:61); the previous agent re-bound t1
  // before it was killed, and t2 still shows the old connection.
  state::Volume v = Vol("f");
  v.set_kind("fuse");
  v.set_staging_path("/k/s");
  v.mutable_staging_mount()->set_dev_major(0);
  v.mutable_staging_mount()->set_dev_minor(61);
  v.mutable_staging_mount()->set_root("/");
  for (const char* p : {"/k/t1", "/k/t2", "/k/t3"}) {
    auto* t = v.add_targets();
    t->set_path(p);
    t->mutable_mount()->set_dev_major(0);
    t->mutable_mount()->set_dev_minor(60);
    t->mutable_mount()->set_root("/");
  }
  auto out = Reconcile({v},
                       Table("10 1 0:61 / /k/s rw - fuse.other x rw\n"
                             "11 1 0:61 / /k/t1 rw - fuse.other x rw\n"
                             "12 1 0:60 / /k/t2 rw - fuse.fusekeeper f rw\n"
                             "13 1 0:77 / /k/t3 rw - tmpfs x rw\n"),
                       Same);
  ASSERT_EQ(out.volumes.size(), 1u);
  const auto& r = out.volumes[0];
  ASSERT_EQ(r.targets_size(), 2) << "t3 (something else) is forgotten";
  EXPECT_EQ(r.targets(0).path(), "/k/t1");
  EXPECT_EQ(r.targets(0).mount().dev_minor(), 61u) << "the re-bound target is adopted";
  EXPECT_EQ(r.targets(1).path(), "/k/t2");
  EXPECT_EQ(r.targets(1).mount().dev_minor(), 60u) << "the stale bind is kept for the audit to re-bind";
}

}  // namespace
}  // namespace fusekeeper
