#include "agent/loop/lifetime.h"

#include <memory>

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

}  // namespace
}  // namespace fusekeeper
