// EventRecorder against the API-server double over real HTTPS: fields, dedup as PATCHes,
// aggregation, the spam filter, retries, refusals, and a slow server that never stalls the loop.
#include "agent/kube/event_recorder.h"

#include <fstream>
#include <future>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/testing/api_client_test.h"
#include "tests/testing/fake_kube.h"
#include "tests/testing/loop_thread.h"
#include <filesystem>

namespace fusekeeper {
namespace {

class EventRecorderTest : public ApiClientTest {
 protected:
  void DestroyClient() override { recorder_.reset(); }
  void MakeRecorder(EventRecorderOptions o = {}) {
    KubeApiConfig api = Api();
    o.host = "node-1";
    o.first_backoff = absl::Milliseconds(20);
    lt_.RunOnLoop([&] { recorder_ = std::make_unique<EventRecorder>(lt_.loop(), *http_, *pool_, api, o); });
  }
  void Record(const std::string& reason, const std::string& message, const std::string& pod = "app-1") {
    lt_.RunOnLoop([&] { recorder_->Record({"default", pod, "uid-" + pod}, "Warning", reason, message); });
  }
  // Waits until the recorder has nothing left to send, then returns its stats.
  EventRecorder::Stats Settled() {
    std::promise<void> idle;
    lt_.RunOnLoop([&] { recorder_->WhenIdle([&] { idle.set_value(); }); });
    EXPECT_EQ(idle.get_future().wait_for(kTestDeadline), std::future_status::ready);
    return Stats();
  }
  EventRecorder::Stats Stats() {
    EventRecorder::Stats s;
    lt_.RunOnLoop([&] { s = recorder_->stats(); });
    return s;
  }

  std::unique_ptr<EventRecorder> recorder_;
};

TEST_F(EventRecorderTest, PostsAnEventAboutThePodOverVerifiedTlsWithTheToken) {
  MakeRecorder();
  Record("MountRecovered", "volume v: all 2 mount(s) answer");
  ASSERT_TRUE(kube_->WaitForRequests(1)) << kube_->Diagnostics();
  const std::string line = kube_->Log().at(0);
  EXPECT_TRUE(absl::StrContains(line, "\"verb\": \"POST\"")) << line;
  EXPECT_TRUE(absl::StrContains(line, "/api/v1/namespaces/default/events")) << line;
  EXPECT_TRUE(absl::StrContains(line, "Bearer secret-token")) << line;
  for (const char* want : {"\\\"reason\\\":\\\"MountRecovered\\\"", "\\\"kind\\\":\\\"Pod\\\"", "\\\"name\\\":\\\"app-1\\\"",
                           "\\\"uid\\\":\\\"uid-app-1\\\"", "\\\"component\\\":\\\"fusekeeper\\\"", "\\\"host\\\":\\\"node-1\\\"",
                           "\\\"reportingComponent\\\":\\\"fusekeeper\\\"", "\\\"reportingInstance\\\":\\\"node-1\\\"",
                           "\\\"type\\\":\\\"Warning\\\"", "\\\"count\\\":1", "firstTimestamp"}) {
    EXPECT_TRUE(absl::StrContains(line, want)) << want << " in " << line;
  }
}

TEST_F(EventRecorderTest, RepeatsBecomeCountPatchesOfTheSameEvent) {
  MakeRecorder();
  Record("FuseServerNotConnected", "server gone");
  ASSERT_TRUE(kube_->WaitForRequests(1));
  Record("FuseServerNotConnected", "server gone");
  Record("FuseServerNotConnected", "server gone");
  ASSERT_TRUE(kube_->WaitForRequests(3));
  auto log = kube_->Log();
  EXPECT_TRUE(absl::StrContains(log[1], "\"verb\": \"PATCH\"")) << log[1];
  EXPECT_TRUE(absl::StrContains(log[2], "\\\"count\\\":3") || absl::StrContains(log[1], "\\\"count\\\":3")) << log[2];
  EXPECT_EQ(Settled().patched, 2);
}

TEST_F(EventRecorderTest, SimilarEventsAreAggregatedAndTheSpamFilterCapsBurstsAt25) {
  MakeRecorder();
  for (int i = 0; i < 40; ++i) Record("MountRecoveryFailed", "attempt " + std::to_string(i));
  ASSERT_TRUE(kube_->WaitForRequests(25)) << kube_->Diagnostics();
  // The 26th..40th were dropped before any request: nothing more arrives.
  auto s = Settled();
  EXPECT_EQ(s.spam_dropped, 15);
  EXPECT_EQ(s.posted + s.patched, 25);
  EXPECT_EQ(s.posted, 10) << "9 distinct messages, then one combined event";
  EXPECT_EQ(s.patched, 15) << "further similar events are count updates of the combined one";
  bool combined = false;
  for (const auto& l : kube_->Log()) combined |= absl::StrContains(l, "(combined from similar events): ");
  EXPECT_TRUE(combined);
  // Another pod has its own bucket.
  Record("MountRecoveryFailed", "other", "app-2");
  ASSERT_TRUE(kube_->WaitForRequests(26));
}

TEST_F(EventRecorderTest, ServerErrorsAreRetriedRefusalsAreDropped) {
  MakeRecorder();
  kube_->SetMode("500");
  Record("MountRecovered", "one");
  ASSERT_TRUE(kube_->WaitForRequests(2)) << "retried after a 500";
  kube_->SetMode("ok");
  auto settled = Settled();  // retries go on until one succeeds
  EXPECT_EQ(settled.posted, 1);
  EXPECT_GE(settled.retries, 1);
  kube_->SetMode("403");
  const int before = kube_->requests();
  Record("MountRecovered", "two");
  EXPECT_EQ(Settled().failed, 1) << "a 403 is not retried";
  EXPECT_EQ(kube_->requests(), before + 1);
}

TEST_F(EventRecorderTest, ASlowApiServerNeverStallsTheLoop) {
  EventRecorderOptions o;
  o.request_timeout = absl::Seconds(60);
  MakeRecorder(o);
  kube_->SetMode("slow");
  for (int i = 0; i < 8; ++i) Record("MountRecovered", "m" + std::to_string(i), "pod-" + std::to_string(i));
  ASSERT_TRUE(kube_->WaitForRequests(4)) << "four requests in flight at once";
  // The loop still runs other work at once.
  for (int i = 0; i < 100; ++i) lt_.RunOnLoop([] {});
  size_t queued = 0;
  lt_.RunOnLoop([&] { queued = recorder_->queued(); });
  EXPECT_EQ(queued, 4u) << "the rest wait in the bounded queue";
}

}  // namespace
}  // namespace fusekeeper
