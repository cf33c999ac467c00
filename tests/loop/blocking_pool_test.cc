#include "agent/loop/blocking_pool.h"

#include <atomic>
#include <future>
#include <thread>

#include "gtest/gtest.h"
#include "tests/testing/loop_thread.h"

namespace fusekeeper {
namespace {

TEST(BlockingPoolTest, WorkRunsOffLoopAndDoneRunsOnLoop) {
  LoopThread lt;
  BlockingPool pool(lt.loop(), {.threads = 2, .max_queued = 16});
  std::promise<void> done;
  std::thread::id work_thread;
  ASSERT_TRUE(pool.Submit(
                      "test",
                      [&] {
                        work_thread = std::this_thread::get_id();
                        EXPECT_FALSE(lt.loop().IsLoopThread());
                      },
                      [&](absl::Status s) {
                        EXPECT_TRUE(s.ok()) << s;
                        EXPECT_TRUE(lt.loop().IsLoopThread());
                        done.set_value();
                      })
                  .ok());
  ASSERT_EQ(done.get_future().wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_NE(work_thread, std::this_thread::get_id());
  EXPECT_EQ(pool.Shutdown(absl::Seconds(5)), 0);
}

TEST(BlockingPoolTest, TypedRunHandsResultToLoop) {
  LoopThread lt;
  BlockingPool pool(lt.loop(), {});
  std::promise<absl::StatusOr<int>> result;
  ASSERT_TRUE(pool.Run<int>("answer", [] { return 42; },
                            [&](absl::StatusOr<int> v) { result.set_value(std::move(v)); })
                  .ok());
  auto f = result.get_future();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  auto v = f.get();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 42);
  pool.Shutdown(absl::Seconds(5));
}

TEST(BlockingPoolTest, ManyJobsAllCompleteExactlyOnce) {
  LoopThread lt;
  BlockingPool pool(lt.loop(), {.threads = 4, .max_queued = 10000});
  constexpr int kJobs = 5000;
  std::atomic<int> worked{0}, completed{0};
  std::promise<void> all;
  for (int i = 0; i < kJobs; ++i) {
    ASSERT_TRUE(pool.Submit("job", [&] { worked++; },
                            [&](absl::Status s) {
                              EXPECT_TRUE(s.ok());
                              if (++completed == kJobs) all.set_value();
                            })
                    .ok());
  }
  ASSERT_EQ(all.get_future().wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(worked.load(), kJobs);
  EXPECT_EQ(pool.outstanding(), 0u);
  pool.Shutdown(absl::Seconds(5));
}

// Holds the single worker until released, so the queue can be filled deterministically.
struct Gate {
  std::promise<void> entered;
  std::promise<void> release;
  std::shared_future<void> released{release.get_future().share()};
};

TEST(BlockingPoolTest, FullQueueIsRejectedNotGrown) {
  LoopThread lt;
  BlockingPool pool(lt.loop(), {.threads = 1, .max_queued = 3});
  Gate gate;
  ASSERT_TRUE(pool.Submit("blocker", [&] { gate.entered.set_value(); gate.released.wait(); },
                          [](absl::Status) {})
                  .ok());
  ASSERT_EQ(gate.entered.get_future().wait_for(kTestDeadline), std::future_status::ready);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(pool.Submit("q", [] {}, [](absl::Status) {}).ok());
  bool ran = false;
  absl::Status s = pool.Submit("overflow", [&] { ran = true; }, [&](absl::Status) { ran = true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("overflow"), absl::string_view::npos) << s;
  gate.release.set_value();
  pool.Shutdown(absl::Seconds(5));
  EXPECT_FALSE(ran);
}

TEST(BlockingPoolTest, ShutdownCancelsQueuedWorkAndFinishesRunningWork) {
  LoopThread lt;
  BlockingPool pool(lt.loop(), {.threads = 1, .max_queued = 10});
  Gate gate;
  std::promise<absl::Status> running_done;
  ASSERT_TRUE(pool.Submit("running", [&] { gate.entered.set_value(); gate.released.wait(); },
                          [&](absl::Status s) { running_done.set_value(s); })
                  .ok());
  ASSERT_EQ(gate.entered.get_future().wait_for(kTestDeadline), std::future_status::ready);
  std::atomic<int> cancelled{0};
  std::atomic<bool> queued_ran{false};
  std::promise<void> all_cancelled;
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(pool.Submit("queued", [&] { queued_ran = true; },
                            [&](absl::Status s) {
                              EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
                              if (++cancelled == 5) all_cancelled.set_value();
                            })
                    .ok());
  }
  pool.BeginShutdown();
  EXPECT_EQ(pool.Submit("late", [] {}, [](absl::Status) {}).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(all_cancelled.get_future().wait_for(kTestDeadline), std::future_status::ready);
  gate.release.set_value();
  EXPECT_EQ(pool.Shutdown(absl::Seconds(10)), 0);
  auto f = running_done.get_future();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(f.get().ok());
  EXPECT_FALSE(queued_ran.load());
}

TEST(BlockingPoolTest, ElasticPoolGivesHungWorkItsOwnThreadsUpToTheCap) {
  LoopThread lt;
  BlockingPool pool(lt.loop(), {.threads = 1, .max_threads = 3, .max_queued = 16});
  auto release = std::make_shared<std::promise<void>>();
  std::shared_future<void> released = release->get_future().share();
  std::atomic<int> running{0};
  std::vector<std::shared_ptr<std::promise<void>>> entered;
  // Three items that hang until released: each gets a thread of its own.
  for (int i = 0; i < 3; ++i) {
    auto p = std::make_shared<std::promise<void>>();
    entered.push_back(p);
    ASSERT_TRUE(pool.Submit("hung", [p, released, &running] { running++; p->set_value(); released.wait(); },
                            [](absl::Status) {})
                    .ok());
  }
  for (auto& p : entered) ASSERT_EQ(p->get_future().wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(running.load(), 3);
  // At the cap: a fourth item waits for a thread instead of getting a new one.
  std::promise<void> fourth;
  ASSERT_TRUE(pool.Submit("healthy", [&] { fourth.set_value(); }, [](absl::Status) {}).ok());
  auto f = fourth.get_future();
  EXPECT_EQ(f.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  release->set_value();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(pool.Shutdown(absl::Seconds(5)), 0);
}

TEST(BlockingPoolTest, FixedPoolDoesNotGrow) {
  LoopThread lt;
  BlockingPool pool(lt.loop(), {.threads = 1, .max_queued = 16});
  auto release = std::make_shared<std::promise<void>>();
  std::shared_future<void> released = release->get_future().share();
  std::promise<void> entered;
  ASSERT_TRUE(pool.Submit("hung", [&, released] { entered.set_value(); released.wait(); }, [](absl::Status) {}).ok());
  ASSERT_EQ(entered.get_future().wait_for(kTestDeadline), std::future_status::ready);
  std::promise<void> second;
  ASSERT_TRUE(pool.Submit("next", [&] { second.set_value(); }, [](absl::Status) {}).ok());
  auto f = second.get_future();
  EXPECT_EQ(f.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  release->set_value();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  pool.Shutdown(absl::Seconds(5));
}

TEST(BlockingPoolTest, ShutdownAbandonsHungWorkAfterGrace) {
  LoopThread lt;
  auto gate = std::make_shared<Gate>();  // outlives the test body: the abandoned thread holds it
  auto pool = std::make_unique<BlockingPool>(lt.loop(), BlockingPoolOptions{.threads = 2});
  bool done_ran = false;
  ASSERT_TRUE(pool->Submit("hung-syscall", [gate] { gate->entered.set_value(); gate->released.wait(); },
                           [&](absl::Status) { done_ran = true; })
                  .ok());
  ASSERT_EQ(gate->entered.get_future().wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(pool->Shutdown(absl::Milliseconds(50)), 1);
  pool.reset();
  gate->release.set_value();  // the abandoned worker finishes without touching the pool
  lt.RunOnLoop([] {});
  EXPECT_FALSE(done_ran);
}

}  // namespace
}  // namespace fusekeeper
