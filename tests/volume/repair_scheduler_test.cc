#include "agent/volume/repair_scheduler.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

// Runs on the test's own thread: the loop runs only inside RunUntilStopped.
class RepairSchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto l = Loop::Create();
    ASSERT_TRUE(l.ok()) << l.status();
    loop_ = std::move(*l);
  }
  // Runs the loop until something on it calls loop_->Stop().
  void RunUntilStopped() { loop_->Run(); }

  std::unique_ptr<Loop> loop_;
};

TEST_F(RepairSchedulerTest, BackoffDoublesPerVolumeUpToTheMaxAndStartsOverAfterASuccess) {
  RepairScheduler s(*loop_, absl::Milliseconds(1), absl::Milliseconds(5));
  EXPECT_EQ(s.RetryLater("a", [] {}), absl::Milliseconds(1));
  EXPECT_EQ(s.RetryLater("a", [] {}), absl::Milliseconds(2));
  EXPECT_EQ(s.RetryLater("b", [] {}), absl::Milliseconds(1)) << "each volume has its own";
  EXPECT_EQ(s.RetryLater("a", [] {}), absl::Milliseconds(4));
  EXPECT_EQ(s.RetryLater("a", [] {}), absl::Milliseconds(5)) << "capped";
  EXPECT_EQ(s.RetryLater("a", [] {}), absl::Milliseconds(5));
  s.Failed("a");
  EXPECT_EQ(s.RetryLater("a", [] {}), absl::Milliseconds(5)) << "a failure keeps the backoff";
  s.Succeeded("a");
  EXPECT_EQ(s.RetryLater("a", [] {}), absl::Milliseconds(1)) << "a success starts it over";
  EXPECT_EQ(s.retries_pending(), 8u);
}

TEST_F(RepairSchedulerTest, TracksRunningRepairsPerVolume) {
  RepairScheduler s(*loop_, absl::Milliseconds(1), absl::Milliseconds(5));
  EXPECT_FALSE(s.running("a"));
  s.Began("a");
  EXPECT_TRUE(s.running("a"));
  EXPECT_FALSE(s.running("b"));
  s.Failed("a");
  EXPECT_FALSE(s.running("a"));
  s.Began("a");
  s.Succeeded("a");
  EXPECT_FALSE(s.running("a"));
}

TEST_F(RepairSchedulerTest, RetriesRunInDeadlineOrderAndMayScheduleMore) {
  RepairScheduler s(*loop_, absl::Milliseconds(1), absl::Milliseconds(8));
  std::vector<std::string> ran;
  s.RetryLater("a", [&] { ran.push_back("a1"); });  // 1 ms
  s.RetryLater("a", [&] {                           // 2 ms
    ran.push_back("a2");
    s.RetryLater("a", [&] {  // 4 ms from now: a retry that fails again
      ran.push_back("a3");
      loop_->Stop();
    });
  });
  s.RetryLater("b", [&] { ran.push_back("b1"); });  // 1 ms, armed after a1
  RunUntilStopped();
  EXPECT_EQ(ran, (std::vector<std::string>{"a1", "b1", "a2", "a3"}));
  EXPECT_EQ(s.retries_pending(), 0u) << "each retry forgets its timer when it runs";
}

TEST_F(RepairSchedulerTest, ADestroyedSchedulerRunsNoRetry) {
  bool ran = false;
  {
    RepairScheduler s(*loop_, absl::Milliseconds(1), absl::Milliseconds(1));
    s.RetryLater("a", [&] { ran = true; });
  }
  // A later deadline than the retry's would have been: by then it would have run.
  loop_->AddTimer(std::chrono::milliseconds(20), [&] { loop_->Stop(); });
  RunUntilStopped();
  EXPECT_FALSE(ran);
}

}  // namespace
}  // namespace fusekeeper
