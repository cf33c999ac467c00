#include "agent/loop/poll_watch.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <future>
#include <memory>

#include "gtest/gtest.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/loop_without_ring.h"

namespace fusekeeper {
namespace {

// Each test runs on both of the Loop's backends: the ring, and epoll (where io_uring is refused).
class PollWatchTest : public ::testing::TestWithParam<bool> {
 protected:
  static std::unique_ptr<Loop> MakeLoop(bool epoll) {
    if (epoll) {
      std::unique_ptr<Loop> loop = LoopWithoutRing();
      CHECK(loop != nullptr && !loop->without_ring_why().empty()) << "no seccomp filter here";
      return loop;
    }
    auto loop = Loop::Create();
    CHECK(loop.ok()) << loop.status();
    return std::move(*loop);
  }
  PollWatchTest() : lt_(MakeLoop(GetParam())) {
    CHECK_EQ(pipe2(p_, O_CLOEXEC | O_NONBLOCK), 0);
  }
  ~PollWatchTest() override {
    lt_.StopAndJoin();
    close(p_[0]);
    close(p_[1]);
  }
  void Write() { ASSERT_EQ(write(p_[1], "x", 1), 1); }
  void Drain() {
    char buf[64];
    while (read(p_[0], buf, sizeof(buf)) > 0) {
    }
  }
  LoopThread lt_;
  int p_[2];
};

TEST_P(PollWatchTest, AMultishotWatchReportsEachNewsUntilItsOwnerDropsItFromItsCallback) {
  std::unique_ptr<PollWatch> watch;
  int calls = 0;
  std::promise<void> second;
  lt_.RunOnLoop([&] {
    watch = std::make_unique<PollWatch>(lt_.loop(), p_[0], POLLIN, /*multishot=*/true, [&](int res) {
      EXPECT_GT(res, 0);
      EXPECT_TRUE(res & POLLIN);
      Drain();
      if (++calls == 2) {
        watch.reset();  // from its own callback: the watch must survive that
        second.set_value();
      }
    });
  });
  Write();
  lt_.RunOnLoop([] {});
  // The first news was taken; a second write is news again.
  for (int i = 0; i < 200 && calls < 1; ++i) lt_.RunOnLoop([] {});
  Write();
  ASSERT_EQ(second.get_future().wait_for(kTestDeadline), std::future_status::ready);
  // Dropped: more writes reach no callback.
  Write();
  lt_.RunOnLoop([] {});
  lt_.RunOnLoop([] {});
  lt_.RunOnLoop([&] { EXPECT_EQ(calls, 2); });
}

TEST_P(PollWatchTest, ASingleShotWatchFiresOnceAndIsThenInactive) {
  std::unique_ptr<PollWatch> watch;
  std::promise<int> fired;
  int calls = 0;
  lt_.RunOnLoop([&] {
    watch = std::make_unique<PollWatch>(lt_.loop(), p_[0], POLLIN, /*multishot=*/false, [&](int res) {
      if (++calls == 1) fired.set_value(res);
    });
    EXPECT_TRUE(watch->active());
  });
  Write();
  auto f = fired.get_future();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(f.get() & POLLIN);
  Write();
  lt_.RunOnLoop([] {});
  lt_.RunOnLoop([&] {
    EXPECT_EQ(calls, 1);
    EXPECT_FALSE(watch->active());
    watch.reset();
  });
}

TEST_P(PollWatchTest, AWatchDroppedInFlightNeverCallsBackAndIsFreedByTheLoop) {
  int calls = 0;
  lt_.RunOnLoop([&] {
    // Dropped while armed: its completion is the loop's to free (LeakSanitizer checks that).
    auto watch = std::make_unique<PollWatch>(lt_.loop(), p_[0], POLLIN, /*multishot=*/true, [&](int) { ++calls; });
    watch.reset();
  });
  Write();
  lt_.RunOnLoop([] {});
  lt_.RunOnLoop([&] { EXPECT_EQ(calls, 0); });
  // And one still armed when the loop stops is called back by no one and freed with it.
  std::unique_ptr<PollWatch> kept;
  lt_.RunOnLoop([&] {
    Drain();
    kept = std::make_unique<PollWatch>(lt_.loop(), p_[0], POLLIN, /*multishot=*/true, [&](int) { ++calls; });
  });
  lt_.StopAndJoin();
  EXPECT_FALSE(kept->active());
  kept.reset();
  EXPECT_EQ(calls, 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, PollWatchTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "epoll" : "ring"; });

}  // namespace
}  // namespace fusekeeper
