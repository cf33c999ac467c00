// VolumeManager in-process, with its one pool thread held hostage where a test needs an operation
// provably in flight: RPCs on the same volume wait their turn, no waiting across volumes, the stats deadline.
#include "agent/volume/host_path_kind.h"
#include "agent/volume/volume_manager.h"

#include <filesystem>
#include <future>

#include "gtest/gtest.h"
#include "tests/testing/csi_client.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/mount_fixture.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;

class VolumeManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(root_.path() + "/kubelet/pods");
    data_ = root_.path() + "/data";
    fs::create_directories(data_);
    auto k = KubeletDir::Open(root_.path() + "/kubelet");
    ASSERT_TRUE(k.ok());
    kubelet_ = std::make_unique<KubeletDir>(std::move(*k));
    auto st = StateStore::Open(root_.path() + "/state");
    ASSERT_TRUE(st.ok());
    store_ = std::make_unique<StateStore>(std::move(*st));
    pool_ = std::make_unique<BlockingPool>(lt_.loop(), BlockingPoolOptions{.threads = 1});
    probe_pool_ = std::make_unique<BlockingPool>(lt_.loop(), BlockingPoolOptions{.threads = 1});
    lt_.RunOnLoop([&] {
      auto r = MountTableReader::Create(lt_.loop());
      ASSERT_TRUE(r.ok());
      reader_ = std::move(*r);
      manager_ = std::make_unique<VolumeManager>(lt_.loop(), *pool_, *kubelet_, *store_, *reader_,
                                                 VolumeManagerOptions{absl::Milliseconds(50)},
                                                 probe_pool_.get());
      manager_->AddKind(std::make_unique<HostPathKind>(*manager_));
    });
  }
  void TearDown() override {
    // None if SetUp failed before making them: a failure, not a crash.
    if (pool_) pool_->Shutdown(absl::Seconds(5));
    if (probe_pool_) probe_pool_->Shutdown(absl::Seconds(5));
    lt_.StopAndJoin();
  }
  void StartManager() {
    std::promise<absl::Status> started;
    lt_.RunOnLoop([&] { manager_->Start([&](absl::Status s) { started.set_value(s); }); });
    auto f = started.get_future();
    ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
    ASSERT_TRUE(f.get().ok());
  }
  csi::v1::NodeStageVolumeRequest StageReq(const std::string& id) {
    csi::v1::NodeStageVolumeRequest r;
    r.set_volume_id(id);
    std::string staging = root_.path() + "/kubelet/plugins/" + id + "/globalmount";
    fs::create_directories(staging);
    r.set_staging_target_path(staging);
    *r.mutable_volume_capability() = MountCapability();
    (*r.mutable_volume_context())["kind"] = "hostPath";
    (*r.mutable_volume_context())["path"] = data_;
    return r;
  }
  // Calls Stage on the loop; returns a future of its result.
  std::future<absl::Status> Stage(const csi::v1::NodeStageVolumeRequest& r) {
    auto p = std::make_shared<std::promise<absl::Status>>();
    auto f = p->get_future();
    lt_.RunOnLoop([&, p] { manager_->Stage(r, [p](absl::Status s) { p->set_value(s); }); });
    return f;
  }
  // Stages `r` and waits for it to succeed.
  void StageOk(const csi::v1::NodeStageVolumeRequest& r) {
    auto staged = Stage(r);
    ASSERT_EQ(staged.wait_for(kTestDeadline), std::future_status::ready);
    ASSERT_TRUE(staged.get().ok());
  }
  // Calls Unstage on the loop for what `stage` staged; returns a future of its result.
  std::future<absl::Status> Unstage(const csi::v1::NodeStageVolumeRequest& stage) {
    csi::v1::NodeUnstageVolumeRequest r;
    r.set_volume_id(stage.volume_id());
    r.set_staging_target_path(stage.staging_target_path());
    auto p = std::make_shared<std::promise<absl::Status>>();
    auto f = p->get_future();
    lt_.RunOnLoop([&, p] { manager_->Unstage(r, [p](absl::Status s) { p->set_value(s); }); });
    return f;
  }
  // Calls Publish on the loop for pod `pod`'s target of staged volume v; returns a future of its result.
  std::future<absl::Status> PublishStaged(const csi::v1::NodeStageVolumeRequest& stage, const std::string& pod) {
    csi::v1::NodePublishVolumeRequest r;
    r.set_volume_id("v");
    r.set_staging_target_path(stage.staging_target_path());
    const std::string parent = root_.path() + "/kubelet/pods/" + pod + "/volumes/kubernetes.io~csi/v";
    fs::create_directories(parent);
    r.set_target_path(parent + "/mount");
    *r.mutable_volume_capability() = MountCapability();
    auto p = std::make_shared<std::promise<absl::Status>>();
    auto f = p->get_future();
    lt_.RunOnLoop([&, r, p] { manager_->Publish(r, [p](absl::Status s) { p->set_value(s); }); });
    return f;
  }
  // Occupies the only thread of `pool` (the mount pool by default) until the returned promise is
  // fulfilled.
  std::shared_ptr<std::promise<void>> HoldPool(BlockingPool* pool = nullptr) {
    if (pool == nullptr) pool = pool_.get();
    auto release = std::make_shared<std::promise<void>>();
    auto held = std::make_shared<std::promise<void>>();
    auto f = release->get_future().share();
    EXPECT_TRUE(pool->Submit("hostage", [held, f] { held->set_value(); f.wait(); }, [](absl::Status) {}).ok());
    EXPECT_EQ(held->get_future().wait_for(kTestDeadline), std::future_status::ready);
    return release;
  }

  TmpfsDir root_;
  std::string data_;
  LoopThread lt_;
  std::unique_ptr<KubeletDir> kubelet_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<BlockingPool> pool_;
  std::unique_ptr<BlockingPool> probe_pool_;
  std::unique_ptr<MountTableReader> reader_;
  std::unique_ptr<VolumeManager> manager_;
};

TEST_F(VolumeManagerTest, UnavailableUntilStateIsReconciled) {
  auto f = Stage(StageReq("v"));
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(f.get().code(), absl::StatusCode::kUnavailable);
}

TEST_F(VolumeManagerTest, SecondRpcForABusyVolumeWaitsItsTurnOtherVolumesProceed) {
  StartManager();
  auto release = HoldPool();
  auto first = Stage(StageReq("v"));     // queued behind the hostage: v is busy
  auto second = Stage(StageReq("v"));    // waits for v, no ABORTED for kubelet to back off from
  auto other = Stage(StageReq("w"));     // a different volume is not held up by v
  EXPECT_EQ(second.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  EXPECT_EQ(other.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  release->set_value();
  ASSERT_EQ(first.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(first.get().ok());
  ASSERT_EQ(second.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(second.get().ok()) << "the repeat ran after the first, and found it done";
  ASSERT_EQ(other.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(other.get().ok());
  EXPECT_EQ(MountCountAt(StageReq("v").staging_target_path()), 1);
}

// The per-volume queue is bounded in length and in wait, and says which volume and why.
TEST_F(VolumeManagerTest, QueueBoundsAnswerWithClearErrorsNamingTheVolume) {
  lt_.RunOnLoop([&] {
    manager_ = std::make_unique<VolumeManager>(
        lt_.loop(), *pool_, *kubelet_, *store_, *reader_,
        VolumeManagerOptions{.stats_timeout = absl::Milliseconds(50),
                             .max_queued_per_volume = 2,
                             .max_queue_wait = absl::Milliseconds(300)},
        probe_pool_.get());
    manager_->AddKind(std::make_unique<HostPathKind>(*manager_));
  });
  StartManager();
  auto release = HoldPool();
  auto first = Stage(StageReq("v"));  // holds v's claim (its work waits behind the hostage)
  auto second = Stage(StageReq("v"));
  auto third = Stage(StageReq("v"));
  auto fourth = Stage(StageReq("v"));  // the queue holds 2
  ASSERT_EQ(fourth.wait_for(kTestDeadline), std::future_status::ready);
  absl::Status full = fourth.get();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("volume v"), std::string::npos) << full;
  // The two waiting give up after max_queue_wait, saying what they waited on.
  ASSERT_EQ(second.wait_for(kTestDeadline), std::future_status::ready);
  absl::Status waited = second.get();
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  EXPECT_NE(waited.message().find("for an operation on volume v"), std::string::npos) << waited;
  ASSERT_EQ(third.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(third.get().code(), absl::StatusCode::kAborted);
  release->set_value();
  ASSERT_EQ(first.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(first.get().ok());
}

// Publishes of distinct targets of one staged volume are handed to the pool together instead of
// waiting for each other; a second publish of the same target, and an unstage, still wait.
TEST_F(VolumeManagerTest, DistinctTargetsOfAStagedVolumeDoNotWaitForEachOther) {
  StartManager();
  const auto stage = StageReq("v");
  ASSERT_NO_FATAL_FAILURE(StageOk(stage));
  auto publish = [&](const std::string& pod) { return PublishStaged(stage, pod); };
  auto release = HoldPool();
  auto a = publish("a");
  auto b = publish("b");
  auto a_again = publish("a");
  auto unstaged = Unstage(stage);
  size_t outstanding = 0;
  lt_.RunOnLoop([&] { outstanding = pool_->outstanding(); });
  EXPECT_EQ(outstanding, 3u) << "the hostage, and a and b together; the repeat of a and the unstage wait";
  release->set_value();
  for (auto* f : {&a, &b, &a_again}) {
    ASSERT_EQ(f->wait_for(kTestDeadline), std::future_status::ready);
    EXPECT_TRUE(f->get().ok());
  }
  ASSERT_EQ(unstaged.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(unstaged.get().code(), absl::StatusCode::kFailedPrecondition) << "it waited, then saw both targets";
  std::vector<std::string> problems;
  auto saved = store_->LoadAllBlocking(&problems);
  ASSERT_TRUE(saved.ok());
  ASSERT_EQ(saved->size(), 1u);
  EXPECT_EQ((*saved)[0].targets_size(), 2) << "each recorded its own target, neither undid the other's";
}

// Issue 18 item 2: a waiter whose turn comes and that is refused (an unstage of a volume that is
// still published) must still pass the turn on. On the old code the publish of B behind it waited
// out max_queue_wait and came back ABORTED while nothing ran on the volume.
TEST_F(VolumeManagerTest, ARefusedWaiterPassesTheTurnOn) {
  StartManager();
  const auto stage = StageReq("v");
  ASSERT_NO_FATAL_FAILURE(StageOk(stage));
  auto publish = [&](const std::string& pod) { return PublishStaged(stage, pod); };
  auto release = HoldPool();
  auto a = publish("a");  // holds a's claim; its work waits behind the hostage
  auto unstaged = Unstage(stage);
  auto b = publish("b");  // waits behind the unstage (which wants the whole volume)
  release->set_value();
  ASSERT_EQ(a.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(a.get().ok());
  ASSERT_EQ(unstaged.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(unstaged.get().code(), absl::StatusCode::kFailedPrecondition) << "refused when its turn came: a is published";
  ASSERT_EQ(b.wait_for(kTestDeadline), std::future_status::ready) << "the refused unstage never passed the turn on";
  EXPECT_TRUE(b.get().ok());
}

// A rollback to an agent that does not know a newer agent's volume kind: the volume is left out
// (and said so), its state file is kept for the newer agent, and everything else works.
TEST_F(VolumeManagerTest, StateOfAKindThisAgentDoesNotKnowIsLeftAlone) {
  state::Volume future;
  future.set_volume_id("from-a-newer-agent");
  future.set_kind("nfs");
  future.set_staging_path(root_.path() + "/kubelet/plugins/n/globalmount");
  ASSERT_TRUE(store_->SaveBlocking(future).ok());
  StartManager();
  size_t count = 1;
  lt_.RunOnLoop([&] { count = manager_->volume_count(); });
  EXPECT_EQ(count, 0u);
  auto staged = Stage(StageReq("v"));
  ASSERT_EQ(staged.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(staged.get().ok());
  std::vector<std::string> problems;
  auto saved = store_->LoadAllBlocking(&problems);
  ASSERT_TRUE(saved.ok());
  bool kept = false;
  for (const auto& v : *saved) kept = kept || (v.volume_id() == "from-a-newer-agent" && v.kind() == "nfs");
  EXPECT_TRUE(kept) << "its state file is kept";
}

TEST_F(VolumeManagerTest, StatsAnswersAbnormalWithinItsDeadlineWhenStatfsHangs) {
  StartManager();
  auto staged = Stage(StageReq("v"));
  ASSERT_EQ(staged.wait_for(kTestDeadline), std::future_status::ready);
  ASSERT_TRUE(staged.get().ok());
  auto release = HoldPool(probe_pool_.get());  // statfs cannot run: as if it hung on a dead mount
  csi::v1::NodeGetVolumeStatsRequest r;
  r.set_volume_id("v");
  r.set_volume_path(StageReq("v").staging_target_path());
  auto stats = [&] {
    std::promise<absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse>> result;
    auto f = result.get_future();
    lt_.RunOnLoop([&] { manager_->Stats(r, [&](auto resp) { result.set_value(std::move(resp)); }); });
    EXPECT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
    return f.get();
  };
  auto first = stats();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->volume_condition().abnormal());
  EXPECT_NE(first->volume_condition().message().find("did not answer within 50ms"), std::string::npos)
      << first->volume_condition().message();
  // While that probe is still stuck, a second one is answered at once without another thread.
  auto second = stats();
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(second->volume_condition().abnormal());
  EXPECT_NE(second->volume_condition().message().find("has not returned"), std::string::npos)
      << second->volume_condition().message();
  // Mount work is not held up by the stuck probe.
  auto other = Stage(StageReq("w"));
  ASSERT_EQ(other.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(other.get().ok());
  release->set_value();
  lt_.RunOnLoop([] {});  // the late statfs result is dropped, not answered twice
}

}  // namespace
}  // namespace fusekeeper
