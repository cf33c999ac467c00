// Race (issue 18 item 2): 32 threads racing stage/publish/unpublish/unstage on one hostPath and
// one FUSE volume through the real agent, valid RPCs mixed with ones refused after their turn
// comes (unstage while published, publish while unstaged, a repeat with other parameters, the
// wrong staging path). Every RPC must end; none may come back ABORTED (what a wedged queue
// answers after --max_queue_wait_ms); afterwards the volumes still unpublish and unstage, and
// nothing is left mounted. FUSEKEEPER_RACE_SECONDS sets the length (default 8; 60 by hand).
#include <random>
#include <thread>

#include "tests/volume/fuse_fixture.h"

namespace fusekeeper {
namespace {

class RaceTest : public FuseE2ETest {
 protected:
  struct Volume {
    std::string id, staging;
    std::vector<std::string> targets;
    bool fuse;
  };

  grpc::Status Stage(const Volume& v, bool other_parameters) {
    if (v.fuse) return StageFuse(v.id, v.staging, other_parameters ? "4242" : "");
    NodeStageVolumeRequest r;
    r.set_volume_id(v.id);
    r.set_staging_target_path(v.staging);
    *r.mutable_volume_capability() = MountCapability();
    (*r.mutable_volume_context())["kind"] = "hostPath";
    (*r.mutable_volume_context())["path"] = export_;
    if (other_parameters) (*r.mutable_volume_context())["type"] = "Directory";
    NodeStageVolumeResponse resp;
    auto c = Ctx();
    return node_->NodeStageVolume(c.get(), r, &resp);
  }
  grpc::Status Publish(const Volume& v, const std::string& target, bool readonly) {
    NodePublishVolumeRequest r;
    r.set_volume_id(v.id);
    r.set_staging_target_path(v.staging);
    r.set_target_path(target);
    r.set_readonly(readonly);
    *r.mutable_volume_capability() = MountCapability();
    NodePublishVolumeResponse resp;
    auto c = Ctx();
    return node_->NodePublishVolume(c.get(), r, &resp);
  }
  // Once: the fixture's Unpublish retries ABORTED, which is what this test looks for.
  grpc::Status UnpublishOnce(const Volume& v, const std::string& target) {
    NodeUnpublishVolumeRequest r;
    r.set_volume_id(v.id);
    r.set_target_path(target);
    NodeUnpublishVolumeResponse resp;
    auto c = Ctx();
    return node_->NodeUnpublishVolume(c.get(), r, &resp);
  }
  grpc::Status UnstageAt(const Volume& v, const std::string& staging) {
    NodeUnstageVolumeRequest r;
    r.set_volume_id(v.id);
    r.set_staging_target_path(staging);
    NodeUnstageVolumeResponse resp;
    auto c = Ctx();
    return node_->NodeUnstageVolume(c.get(), r, &resp);
  }
};

TEST_F(RaceTest, ThirtyTwoThreadsOnOneVolumeNeverWedgeItsQueue) {
  const int seconds = getenv("FUSEKEEPER_RACE_SECONDS") ? atoi(getenv("FUSEKEEPER_RACE_SECONDS")) : 8;
  // A wedged queue answers ABORTED after this (a wedge is for good: every later RPC on the volume
  // waits it out); every operation here takes milliseconds, even under a sanitizer and load.
  StartAgent({"--max_queue_wait_ms=15000"});
  std::vector<Volume> volumes = {{"race-hostPath", StagingPath("race-hostPath"), {}, false},
                                 {"race-fuse", StagingPath("race-fuse"), {}, true}};
  for (auto& v : volumes) {
    for (int i = 0; i < 4; ++i) v.targets.push_back(Pod("race-pod-" + std::to_string(i), v.id));
  }
  std::mutex mu;
  std::map<std::string, int> outcomes;  // "RPC CODE" -> count
  std::vector<std::string> aborted;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  auto worker = [&](int seed) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    while (std::chrono::steady_clock::now() < end) {
      const Volume& v = volumes[std::uniform_int_distribution<int>(0, 1)(rng)];
      const std::string& target = v.targets[std::uniform_int_distribution<size_t>(0, v.targets.size() - 1)(rng)];
      const int op = std::uniform_int_distribution<int>(0, 9)(rng);
      std::string name;
      grpc::Status s;
      switch (op) {
        case 0: case 1: name = "stage"; s = Stage(v, false); break;
        case 2: name = "stage-other-parameters"; s = Stage(v, true); break;
        case 3: case 4: case 5: name = "publish"; s = Publish(v, target, false); break;
        case 6: name = "publish-readonly"; s = Publish(v, target, true); break;
        case 7: name = "unpublish"; s = UnpublishOnce(v, target); break;
        case 8: name = "unstage"; s = UnstageAt(v, v.staging); break;
        default: name = "unstage-wrong-path"; s = UnstageAt(v, v.staging + "-elsewhere"); break;
      }
      std::lock_guard<std::mutex> lock(mu);
      ++outcomes[name + " " + std::to_string(s.error_code())];
      if (s.error_code() == grpc::ABORTED || s.error_code() == grpc::DEADLINE_EXCEEDED) {
        aborted.push_back(name + " on " + v.id + ": " + s.error_message());
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) threads.emplace_back(worker, i + 1);
  for (auto& t : threads) t.join();
  int total = 0, ok = 0;
  std::string summary;
  for (const auto& [k, n] : outcomes) {
    total += n;
    if (absl::EndsWith(k, " 0")) ok += n;
    summary += k + ": " + std::to_string(n) + "\n";
  }
  std::cout << total << " RPCs in " << seconds << " s, " << ok << " OK\n" << summary;
  const std::string log = agent_->Stderr();
  EXPECT_TRUE(aborted.empty()) << aborted.size() << " RPCs waited out the queue, e.g. " << aborted.front() << "\n"
                               << "the agent's log, its end:\n" << log.substr(log.size() > 8000 ? log.size() - 8000 : 0);
  EXPECT_GT(ok, 100) << summary;
  EXPECT_GT(total - ok, 50) << "refused RPCs are part of the mix\n" << summary;
  // Everything still winds down.
  for (const auto& v : volumes) {
    for (const auto& t : v.targets) ASSERT_RPC_OK(UnpublishOnce(v, t));
    ASSERT_RPC_OK(UnstageAt(v, v.staging));
    EXPECT_EQ(MountCountAt(v.staging), 0) << v.id;
    for (const auto& t : v.targets) EXPECT_EQ(MountCountAt(t), 0) << t;
  }
  int state_files = 0;
  for (const auto& e : fs::directory_iterator(state_ + "/volumes")) state_files += e.is_regular_file();
  EXPECT_EQ(state_files, 0) << "no state left behind";
}

}  // namespace
}  // namespace fusekeeper
