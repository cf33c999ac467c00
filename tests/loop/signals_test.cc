#include "agent/loop/signals.h"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <future>

#include "gtest/gtest.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/loop_without_ring.h"

namespace fusekeeper {
namespace {

// On both of the Loop's backends: the ring, and epoll (where io_uring is refused).
class SignalWatcherTest : public ::testing::TestWithParam<bool> {};

TEST_P(SignalWatcherTest, DeliversSignalsOnTheLoopThread) {
  // Blocked before the loop thread exists, so it inherits the mask.
  BlockSignals({SIGUSR1, SIGUSR2});
  std::unique_ptr<Loop> loop;
  if (GetParam()) {
    loop = LoopWithoutRing();
    ASSERT_TRUE(loop != nullptr && !loop->without_ring_why().empty()) << "no seccomp filter here";
  } else {
    auto l = Loop::Create();
    ASSERT_TRUE(l.ok()) << l.status();
    loop = std::move(*l);
  }
  LoopThread lt(std::move(loop));
  std::promise<pid_t> tid;
  ASSERT_TRUE(lt.loop().Post([&] { tid.set_value(static_cast<pid_t>(syscall(SYS_gettid))); }));
  auto tid_f = tid.get_future();
  ASSERT_EQ(tid_f.wait_for(kTestDeadline), std::future_status::ready);
  const pid_t loop_tid = tid_f.get();

  std::unique_ptr<SignalWatcher> watcher;
  std::vector<int> seen;
  std::promise<void> got_two;
  lt.RunOnLoop([&] {
    auto w = SignalWatcher::Create(lt.loop(), {SIGUSR1, SIGUSR2}, [&](int signo) {
      EXPECT_TRUE(lt.loop().IsLoopThread());
      seen.push_back(signo);
      if (seen.size() == 2) got_two.set_value();
    });
    ASSERT_TRUE(w.ok()) << w.status();
    watcher = std::move(*w);
  });
  // Thread-directed, so no other thread of the test binary can take it.
  ASSERT_EQ(syscall(SYS_tgkill, getpid(), loop_tid, SIGUSR1), 0);
  ASSERT_EQ(syscall(SYS_tgkill, getpid(), loop_tid, SIGUSR2), 0);
  ASSERT_EQ(got_two.get_future().wait_for(kTestDeadline), std::future_status::ready);
  lt.StopAndJoin();
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int>{SIGUSR1, SIGUSR2}));
}

INSTANTIATE_TEST_SUITE_P(Backends, SignalWatcherTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "epoll" : "ring"; });

}  // namespace
}  // namespace fusekeeper
