#include "agent/loop/lifetime.h"

#include <memory>
#include <thread>

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

// Runs on the test's own thread: the loop runs only inside Run().
TEST(LifetimeTest, DeleteLaterDestroysOnlyAfterTheCurrentCallbackHasReturned) {
  auto l = Loop::Create();
  ASSERT_TRUE(l.ok()) << l.status();
  Loop& loop = **l;
  struct Flag {
    bool* destroyed = nullptr;
    ~Flag() {
      if (destroyed != nullptr) *destroyed = true;
    }
  };
  bool destroyed = false;
  bool destroyed_inside = true;
  loop.Post([&] {
    auto flag = std::make_unique<Flag>();
    flag->destroyed = &destroyed;
    DeleteLater(loop, std::move(flag));
    destroyed_inside = destroyed;
    loop.Post([&] { loop.Stop(); });
  });
  loop.Run();
  EXPECT_FALSE(destroyed_inside) << "destroyed inside the callback that handed it over";
  EXPECT_TRUE(destroyed);
}

TEST(LifetimeTest, ATokenSaysWhetherItsOwnerLives) {
  auto owner = std::make_unique<Aliveness>();
  Aliveness::Token t = owner->token();
  Aliveness::Token copy = t;
  EXPECT_TRUE(t.alive());
  owner.reset();
  EXPECT_FALSE(t.alive());
  EXPECT_FALSE(copy.alive());
  Aliveness ended;
  Aliveness::Token e = ended.token();
  ended.End();
  EXPECT_FALSE(e.alive()) << "ended before the owner's members go";
}

// An owner of pending work, as the handoff endpoint is: retired, it is destroyed only once its
// work has ended, and never from inside the callback that ends it.
struct Owner {
  explicit Owner(Loop& loop, bool* destroyed) : work(loop), destroyed(destroyed) {}
  ~Owner() { *destroyed = true; }
  PendingWork work;
  bool* destroyed;
};

TEST(LifetimeTest, ARetiredOwnerLivesUntilItsLastWorkHasEnded) {
  auto l = Loop::Create();
  ASSERT_TRUE(l.ok()) << l.status();
  Loop& loop = **l;
  bool destroyed = false;
  bool destroyed_inside = true;
  bool alive_while_pending = false;
  auto* owner = new Owner(loop, &destroyed);
  loop.Post([&] {
    owner->work.Began();  // a ring operation, say
    owner->work.Began();  // and a second
    owner->work.Retire([owner] { delete owner; });
    loop.Post([&] {
      { PendingWork::EndedGuard first(owner->work); }
      loop.Post([&] {
        alive_while_pending = !destroyed;  // one piece of work is still pending
        { PendingWork::EndedGuard last(owner->work); }
        destroyed_inside = destroyed;
        loop.Post([&] { loop.Post([&] { loop.Stop(); }); });
      });
    });
  });
  loop.Run();
  EXPECT_TRUE(alive_while_pending) << "destroyed with work pending";
  EXPECT_FALSE(destroyed_inside) << "destroyed inside the callback that ended its last work";
  EXPECT_TRUE(destroyed) << "never destroyed";
}

TEST(LifetimeTest, AHoldEndsItsWorkWhereverItIsDestroyed) {
  auto l = Loop::Create();
  ASSERT_TRUE(l.ok()) << l.status();
  Loop& loop = **l;
  bool destroyed = false;
  auto* owner = new Owner(loop, &destroyed);
  std::thread other;
  loop.Post([&] {
    // An answer another thread owes: its callback holds a Hold, and is destroyed there unrun.
    auto answer = std::make_unique<PendingWork::Hold>(owner->work.HoldOne());
    EXPECT_EQ(owner->work.count(), 1);
    owner->work.Retire([&, owner] {
      delete owner;
      loop.Stop();
    });
    other = std::thread([answer = std::move(answer)]() mutable { answer.reset(); });
  });
  loop.Run();
  other.join();
  EXPECT_TRUE(destroyed) << "the owner outlived the work its Hold ended";
}

TEST(LifetimeTest, AnOwnerRetiredAfterItsLoopFinishedIsDestroyedAtOnce) {
  auto l = Loop::Create();
  ASSERT_TRUE(l.ok()) << l.status();
  Loop& loop = **l;
  loop.Post([&] { loop.Stop(); });
  loop.Run();
  ASSERT_TRUE(loop.finished());
  bool destroyed = false;
  auto* owner = new Owner(loop, &destroyed);
  owner->work.Retire([owner] { delete owner; });
  EXPECT_TRUE(destroyed);
}

}  // namespace
}  // namespace fusekeeper
