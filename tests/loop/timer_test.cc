#include "agent/loop/timer.h"

#include <future>
#include <memory>

#include "gtest/gtest.h"
#include "tests/testing/loop_thread.h"

namespace fusekeeper {
namespace {

TEST(TimerTest, FiresOnceIsArmedAgainByItsOwnCallbackAndNeverFiresOnceCancelledOrGone) {
  LoopThread lt;
  std::promise<void> third;
  int fired = 0;
  std::unique_ptr<Timer> t;
  lt.RunOnLoop([&] {
    t = std::make_unique<Timer>(lt.loop());
    EXPECT_FALSE(t->armed());
    t->Arm(std::chrono::milliseconds(1), [&] {
      ++fired;
      EXPECT_FALSE(t->armed()) << "its deadline has passed";
      t->Arm(std::chrono::milliseconds(1), [&] {
        ++fired;
        t.reset();  // destroyed from its own callback
        third.set_value();
      });
    });
  });
  ASSERT_EQ(third.get_future().wait_for(kTestDeadline), std::future_status::ready);
  // Cancelled, and re-armed (the earlier deadline dropped): only the last one fires.
  std::promise<int> last;
  Timer cancelled(lt.loop()), rearmed(lt.loop());
  lt.RunOnLoop([&] {
    cancelled.Arm(std::chrono::milliseconds(1), [&] { ++fired; });
    cancelled.Cancel();
    EXPECT_FALSE(cancelled.armed());
    rearmed.Arm(std::chrono::milliseconds(1), [&] { last.set_value(1); });
    rearmed.Arm(std::chrono::milliseconds(2), [&] { last.set_value(2); });
  });
  auto f = last.get_future();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(f.get(), 2);
  lt.RunOnLoop([&] { EXPECT_EQ(fired, 2); });
  lt.StopAndJoin();
}

// An owner destroyed after its loop's thread has finished (the usual order at exit: stop the loop,
// join it, then destroy what used it) may still hold an armed timer: its destructor is allowed
// off the loop thread then, and the timer never fires.
TEST(TimerTest, AnArmedTimerMayBeDestroyedOnAnotherThreadOnceTheLoopHasFinished) {
  LoopThread lt;
  bool fired = false;
  auto t = std::make_unique<Timer>(lt.loop());
  lt.RunOnLoop([&] { t->Arm(std::chrono::hours(1), [&] { fired = true; }); });
  lt.StopAndJoin();
  EXPECT_TRUE(t->armed());
  t.reset();  // on the test's thread, not the loop's
  EXPECT_FALSE(fired);
}

}  // namespace
}  // namespace fusekeeper
