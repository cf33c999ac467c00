// KubeletPoller against the kubelet double over real HTTPS: restarts reported, and a kubelet
// that refuses, answers garbage or is slow costs errors and backoff, never the loop.
#include "agent/kubelet/kubelet_poller.h"

#include <filesystem>
#include <atomic>
#include <fstream>
#include <future>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_kube.h"
#include "tests/testing/log_capture.h"
#include "tests/testing/loop_thread.h"

namespace fusekeeper {
namespace {

std::string OnePod(int restarts) {
  return absl::StrCat(R"({"kind":"PodList","items":[{"metadata":{"namespace":"ns","name":"app","uid":"u1"},)",
                      R"("status":{"initContainerStatuses":[{"name":"fuse","restartCount":)", restarts, "}]}}]}");
}

class KubeletPollerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char t[] = "/tmp/fk-kubelet-XXXXXX";
    dir_ = mkdtemp(t);
    kube_ = std::make_unique<FakeKube>(dir_);
    ASSERT_TRUE(kube_->ok()) << kube_->Diagnostics();
    kube_->SetPods(OnePod(0));
    { std::ofstream(dir_ + "/token") << "kubelet-token"; }
    pool_ = std::make_unique<BlockingPool>(lt_.loop(), BlockingPoolOptions{.threads = 1});
    lt_.RunOnLoop([&] { http_ = std::move(*HttpClient::Create(lt_.loop())); });
    KubeletPollerOptions o;
    o.url = kube_->url() + "/pods";
    o.token_file = dir_ + "/token";
    o.ca_file = kube_->ca_file();
    o.period = absl::Milliseconds(20);
    o.max_backoff = absl::Milliseconds(100);
    o.timeout = absl::Milliseconds(500);
    lt_.RunOnLoop([&] {
      poller_ = std::make_unique<KubeletPoller>(
          lt_.loop(), *http_, *pool_, o,
          [this](const ContainerRestart& r) {
            std::lock_guard<std::mutex> lock(mu_);
            restarts_.push_back(r);
            cv_.notify_all();
          },
          [this](const std::string& why) {
            std::lock_guard<std::mutex> lock(mu_);
            errors_.push_back(why);
            cv_.notify_all();
          });
      poller_->set_on_pods([this](const std::vector<PodStatus>&) {
        std::lock_guard<std::mutex> lock(mu_);
        ++pod_lists_;
        cv_.notify_all();
      });
      poller_->Start();
    });
  }
  // Waits until a poll has been answered and read: the restart counts so far are known. (A
  // request that has merely arrived may still be answered in the mode the test sets next: the
  // double reads its mode after logging the request. Seen under ASan in CI: the first poll
  // got the 403, the first pod list read was the one already showing the restart, and no
  // restart was reported.)
  bool WaitForPodLists(int n) {
    return WaitFor([&] { return pod_lists_ >= n; });
  }
  void TearDown() override {
    lt_.StopAndJoin();
    poller_.reset();
    http_.reset();
    // A SetUp that failed (the double did not start) made no pool: a failure, not a crash.
    if (pool_) pool_->Shutdown(absl::Seconds(5));
    std::filesystem::remove_all(dir_);
  }
  bool WaitFor(std::function<bool()> pred) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kTestDeadline, pred);
  }

  std::string dir_;
  std::unique_ptr<FakeKube> kube_;
  LoopThread lt_;
  std::unique_ptr<BlockingPool> pool_;
  std::unique_ptr<HttpClient> http_;
  std::unique_ptr<KubeletPoller> poller_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<ContainerRestart> restarts_;
  std::vector<std::string> errors_;
  int pod_lists_ = 0;  // guarded by mu_
};

TEST_F(KubeletPollerTest, ASidecarRestartIsReported) {
  ASSERT_TRUE(WaitForPodLists(1));
  kube_->SetPods(OnePod(1));
  ASSERT_TRUE(WaitFor([&] { return !restarts_.empty(); }));
  EXPECT_EQ(restarts_[0].container, "fuse");
  EXPECT_EQ(restarts_[0].pod_name, "app");
  EXPECT_TRUE(absl::StrContains(kube_->Log().at(0), "Bearer kubelet-token"));
}

TEST_F(KubeletPollerTest, RefusalsGarbageAndSlownessAreErrorsWithBackoffThenItRecovers) {
  ASSERT_TRUE(WaitForPodLists(1));
  kube_->SetMode("403");
  ASSERT_TRUE(WaitFor([&] { return !errors_.empty(); }));
  EXPECT_TRUE(absl::StrContains(errors_.back(), "HTTP 403")) << errors_.back();
  kube_->SetMode("garbage");
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(errors_.back(), "PodList"); })) << errors_.back();
  kube_->SetMode("slow");
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(errors_.back(), "imed out") || absl::StrContains(errors_.back(), "imeout"); }))
      << errors_.back();
  for (int i = 0; i < 50; ++i) lt_.RunOnLoop([] {});  // the loop never stalled
  kube_->SetMode("ok");
  kube_->SetPods(OnePod(3));
  ASSERT_TRUE(WaitFor([&] { return !restarts_.empty(); })) << "recovered after the kubelet came back";
}

// Failing polls are logged once when they start and once when the kubelet answers again, not
// once per poll.
TEST_F(KubeletPollerTest, AnOutageIsLoggedOnceEachWay) {
  ASSERT_TRUE(WaitForPodLists(1));
  LogCapture sink;
  kube_->SetMode("403");
  ASSERT_TRUE(WaitFor([&] { return errors_.size() >= 5; }));
  kube_->SetMode("ok");
  kube_->SetPods(OnePod(2));
  ASSERT_TRUE(WaitFor([&] { return !restarts_.empty(); }));
  lt_.RunOnLoop([] {});
  EXPECT_EQ(sink.Count("polling the kubelet"), 1) << sink.text();
  EXPECT_EQ(sink.Count("answers again, after"), 1) << sink.text();
}

// A kubelet that is down is asked again within seconds, not after a backoff of up to minutes:
// container restarts are seen as soon as it is back.
TEST_F(KubeletPollerTest, AKubeletThatIsNotListeningIsAskedAgainSoon) {
  std::unique_ptr<KubeletPoller> down;
  std::atomic<int> errors{0};
  lt_.RunOnLoop([&] {
    KubeletPollerOptions o;
    o.url = "https://127.0.0.1:1/pods";  // nothing listens
    o.period = absl::Seconds(10);
    o.outage_retry = absl::Milliseconds(20);
    o.max_backoff = absl::Seconds(120);
    down = std::make_unique<KubeletPoller>(lt_.loop(), *http_, *pool_, o, [](const ContainerRestart&) {},
                                           [&](const std::string&) {
                                             std::lock_guard<std::mutex> lock(mu_);
                                             ++errors;
                                             cv_.notify_all();
                                           });
    down->Start();
  });
  ASSERT_TRUE(WaitFor([&] { return errors.load() >= 6; }));
  lt_.RunOnLoop([&] { EXPECT_EQ(down->backoff(), absl::Milliseconds(20)) << "backed off from a kubelet that is down"; });
  lt_.RunOnLoop([&] { down.reset(); });
}

// A rarely polled kubelet is asked at once when the agent needs a fresh look (a server stopped:
// is its pod being deleted?); each caller hears back after a pod list read after its call, and
// callers that come while a poll is in flight get one more poll, not that one's answer.
TEST_F(KubeletPollerTest, PollNowReadsAFreshPodListForEachCallerOnARarelyPolledKubelet) {
  std::unique_ptr<KubeletPoller> rare;
  std::vector<std::string> seen;  // loop thread: the first pod's uid... and whether it terminates
  lt_.RunOnLoop([&] {
    KubeletPollerOptions o;
    o.url = kube_->url() + "/pods";
    o.token_file = dir_ + "/token";
    o.ca_file = kube_->ca_file();
    o.period = absl::Hours(1);
    rare = std::make_unique<KubeletPoller>(lt_.loop(), *http_, *pool_, o, [](const ContainerRestart&) {});
    rare->set_on_pods([&](const std::vector<PodStatus>& pods) {
      std::lock_guard<std::mutex> lock(mu_);
      seen.push_back(!pods.empty() && pods[0].terminating ? "terminating" : "running");
      cv_.notify_all();
    });
    rare->Start();
  });
  ASSERT_TRUE(WaitFor([&] { return seen.size() == 1; }));
  kube_->SetPods(R"({"kind":"PodList","items":[{"metadata":{"namespace":"ns","name":"app","uid":"u1",)"
                 R"("deletionTimestamp":"2026-11-29T00:00:00Z"}}]})");
  int answered = 0;  // loop thread
  std::vector<std::string> when_answered;
  lt_.RunOnLoop([&] {
    for (int i = 0; i < 3; ++i) {
      rare->PollNow([&] {
        std::lock_guard<std::mutex> lock(mu_);
        ++answered;
        when_answered.push_back(seen.back());
        cv_.notify_all();
      });
    }
  });
  ASSERT_TRUE(WaitFor([&] { return answered == 3; }));
  EXPECT_EQ(when_answered, std::vector<std::string>(3, "terminating"));
  // The first caller's poll left at once (the token was read a moment ago); the other two came
  // while it was in flight and shared the one after it.
  lt_.RunOnLoop([&] { EXPECT_EQ(rare->polls(), 3); });
  lt_.RunOnLoop([&] { rare.reset(); });
}

}  // namespace
}  // namespace fusekeeper
