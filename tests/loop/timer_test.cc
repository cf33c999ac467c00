#include "agent/loop/timer.h"

#include <future>
#include <memory>
#include <vector>

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

TEST(TimerTest, TimersFireEachOnceAndNoneOnceTheSetIsGone) {
  LoopThread lt;
  std::promise<void> both;
  std::vector<int> order;
  std::unique_ptr<Timers> set;
  lt.RunOnLoop([&] {
    set = std::make_unique<Timers>(lt.loop());
    set->Add(std::chrono::milliseconds(2), [&] {
      order.push_back(2);
      EXPECT_EQ(set->size(), 0u) << "a fired timer is still in the set";
      // One added from a callback fires too, and the set may be destroyed from it.
      set->Add(std::chrono::milliseconds(1), [&] {
        order.push_back(3);
        set.reset();
        both.set_value();
      });
    });
    set->Add(std::chrono::milliseconds(1), [&] { order.push_back(1); });
    EXPECT_EQ(set->size(), 2u);
  });
  ASSERT_EQ(both.get_future().wait_for(kTestDeadline), std::future_status::ready);
  lt.RunOnLoop([&] { EXPECT_EQ(order, (std::vector<int>{1, 2, 3})); });
  // Destroyed (or cleared) with timers waiting: none of them fires. A plain Timer armed after
  // them, and longer, fires: the loop ran past their deadlines.
  int fired = 0;
  std::promise<void> after;
  Timer later(lt.loop());
  lt.RunOnLoop([&] {
    auto gone = std::make_unique<Timers>(lt.loop());
    gone->Add(std::chrono::milliseconds(1), [&] { ++fired; });
    Timers cleared(lt.loop());
    cleared.Add(std::chrono::milliseconds(1), [&] { ++fired; });
    cleared.CancelAll();
    EXPECT_EQ(cleared.size(), 0u);
    gone.reset();
    later.Arm(std::chrono::milliseconds(5), [&] { after.set_value(); });
  });
  ASSERT_EQ(after.get_future().wait_for(kTestDeadline), std::future_status::ready);
  lt.RunOnLoop([&] { EXPECT_EQ(fired, 0); });
  lt.StopAndJoin();
}

}  // namespace
}  // namespace fusekeeper
