#include "agent/loop/loop.h"

#include <errno.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <poll.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/loop_without_ring.h"

namespace fusekeeper {
namespace {

using std::chrono::milliseconds;

TEST(LoopTest, PostRunsOnLoopThreadInOrder) {
  LoopThread lt;
  std::vector<int> seen;
  std::promise<void> done;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(lt.loop().Post([&, i] {
      EXPECT_TRUE(lt.loop().IsLoopThread());
      seen.push_back(i);
      if (i == 99) done.set_value();
    }));
  }
  ASSERT_EQ(done.get_future().wait_for(kTestDeadline), std::future_status::ready);
  ASSERT_EQ(seen.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(seen[i], i);
  EXPECT_FALSE(lt.loop().IsLoopThread());
}

TEST(LoopTest, PostsFromManyThreadsAllRunOncePreservingPerThreadOrder) {
  LoopThread lt;
  constexpr int kThreads = 8;
  constexpr int kPerThread = 20000;
  std::vector<int> last(kThreads, -1);  // only touched on the loop thread
  std::atomic<int> out_of_order{0};
  std::atomic<int> total{0};
  std::promise<void> all_done;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        bool ok = lt.loop().Post([&, t, i] {
          if (last[t] != i - 1) out_of_order++;
          last[t] = i;
          if (total.fetch_add(1) + 1 == kThreads * kPerThread) all_done.set_value();
        });
        ASSERT_TRUE(ok);
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(all_done.get_future().wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(total.load(), kThreads * kPerThread);
  EXPECT_EQ(out_of_order.load(), 0);
}

TEST(LoopTest, TimersFireInDeadlineOrderAndCancelledOnesNever) {
  LoopThread lt;
  std::vector<int> fired;
  std::promise<void> done;
  lt.RunOnLoop([&] {
    Loop& loop = lt.loop();
    loop.AddTimer(milliseconds(30), [&] { fired.push_back(3); });
    loop.AddTimer(milliseconds(10), [&] { fired.push_back(1); });
    TimerId cancelled = loop.AddTimer(milliseconds(15), [&] { fired.push_back(99); });
    loop.AddTimer(milliseconds(20), [&] { fired.push_back(2); });
    loop.AddTimer(milliseconds(40), [&] { done.set_value(); });
    EXPECT_TRUE(loop.CancelTimer(cancelled));
    EXPECT_FALSE(loop.CancelTimer(cancelled));
  });
  ASSERT_EQ(done.get_future().wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(fired, (std::vector<int>{1, 2, 3}));
}

TEST(LoopTest, TimerDoesNotFireEarly) {
  LoopThread lt;
  std::promise<std::chrono::nanoseconds> elapsed;
  lt.RunOnLoop([&] {
    auto start = LoopClock::now();
    lt.loop().AddTimer(milliseconds(25), [&, start] { elapsed.set_value(LoopClock::now() - start); });
  });
  auto f = elapsed.get_future();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_GE(f.get(), milliseconds(25));
}

TEST(LoopTest, SelfRearmingZeroDelayTimerDoesNotStarvePosts) {
  LoopThread lt;
  std::atomic<bool> stop{false};
  std::atomic<int> ticks{0};
  std::function<void()> tick = [&] {
    ticks++;
    if (!stop) lt.loop().AddTimer(std::chrono::nanoseconds(0), tick);
  };
  lt.RunOnLoop([&] { lt.loop().AddTimer(std::chrono::nanoseconds(0), tick); });
  // A post from another thread still gets through while the timer spins.
  std::promise<void> posted;
  ASSERT_TRUE(lt.loop().Post([&] { posted.set_value(); }));
  ASSERT_EQ(posted.get_future().wait_for(kTestDeadline), std::future_status::ready);
  stop = true;
  lt.RunOnLoop([] {});
  EXPECT_GT(ticks.load(), 0);
}

TEST(LoopTest, ReadCompletesWithData) {
  LoopThread lt;
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd r(p[0]), w(p[1]);
  char buf[16] = {};
  Completion c;
  std::promise<int32_t> result;
  c.callback = [&](int32_t res, bool more) {
    EXPECT_FALSE(more);
    result.set_value(res);
  };
  lt.RunOnLoop([&] { lt.loop().Read(&c, r.get(), buf, sizeof(buf), 0); });
  ASSERT_EQ(write(w.get(), "hello", 5), 5);
  auto f = result.get_future();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(f.get(), 5);
  EXPECT_EQ(std::string(buf, 5), "hello");
}

TEST(LoopTest, MultishotPollDeliversRepeatedlyAndCancelEndsIt) {
  LoopThread lt;
  UniqueFd efd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  ASSERT_TRUE(efd.valid());
  Completion c;
  std::atomic<int> events{0};
  std::promise<int32_t> final_res;
  std::promise<void> first, second;
  c.callback = [&](int32_t res, bool more) {
    if (!more) {
      final_res.set_value(res);
      return;
    }
    uint64_t v;
    ASSERT_EQ(read(efd.get(), &v, sizeof(v)), 8);
    int n = ++events;
    if (n == 1) first.set_value();
    if (n == 2) second.set_value();
  };
  lt.RunOnLoop([&] { lt.loop().PollAdd(&c, efd.get(), POLLIN, /*multishot=*/true); });
  uint64_t one = 1;
  ASSERT_EQ(write(efd.get(), &one, 8), 8);
  ASSERT_EQ(first.get_future().wait_for(kTestDeadline), std::future_status::ready);
  ASSERT_EQ(write(efd.get(), &one, 8), 8);
  ASSERT_EQ(second.get_future().wait_for(kTestDeadline), std::future_status::ready);
  lt.RunOnLoop([&] { lt.loop().Cancel(&c); });
  auto f = final_res.get_future();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(f.get(), -ECANCELED);
  EXPECT_EQ(events.load(), 2);
}

TEST(LoopTest, ThousandsOfConcurrentReadsAllComplete) {
  rlimit lim;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &lim), 0);
  constexpr int kOps = 3000;
  if (lim.rlim_cur < 2 * kOps + 100) {
    lim.rlim_cur = std::min<rlim_t>(lim.rlim_max, 2 * kOps + 100);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lim), 0);
  }
  if (lim.rlim_cur < 2 * kOps + 100) GTEST_SKIP() << "RLIMIT_NOFILE hard limit too low";
  LoopThread lt;
  struct Op {
    UniqueFd r, w;
    char byte = 0;
    Completion c;
  };
  std::vector<Op> ops(kOps);
  std::atomic<int> completed{0};
  std::atomic<int> wrong{0};
  std::promise<void> all;
  for (int i = 0; i < kOps; ++i) {
    int p[2];
    ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
    ops[i].r.Reset(p[0]);
    ops[i].w.Reset(p[1]);
    ops[i].c.callback = [&, i](int32_t res, bool) {
      if (res != 1 || ops[i].byte != static_cast<char>('a' + i % 26)) wrong++;
      if (++completed == kOps) all.set_value();
    };
  }
  lt.RunOnLoop([&] {
    for (auto& op : ops) lt.loop().Read(&op.c, op.r.get(), &op.byte, 1, 0);
  });
  size_t in_flight = 0;
  lt.RunOnLoop([&] { in_flight = lt.loop().in_flight(); });
  EXPECT_GE(in_flight, static_cast<size_t>(kOps));  // all waiting at once (plus the wake read)
  for (int i = 0; i < kOps; ++i) {
    char b = static_cast<char>('a' + i % 26);
    ASSERT_EQ(write(ops[i].w.get(), &b, 1), 1);
  }
  ASSERT_EQ(all.get_future().wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(wrong.load(), 0);
}

TEST(LoopTest, StopCancelsInFlightWorkRunsQueuedPostsThenRefusesPosts) {
  auto loop_or = Loop::Create();
  ASSERT_TRUE(loop_or.ok()) << loop_or.status();
  std::unique_ptr<Loop> loop = std::move(*loop_or);
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd r(p[0]), w(p[1]);
  char buf[4];
  constexpr int kReads = 50;
  std::vector<Completion> reads(kReads);
  std::atomic<int> cancelled{0};
  std::atomic<int> rearm_refused{0};
  Completion rearm;  // armed from a cancellation callback, during stop
  rearm.callback = [&](int32_t res, bool) {
    if (res == -ECANCELED) rearm_refused++;
  };
  bool timer_ran = false;
  for (auto& c : reads) {
    c.callback = [&](int32_t res, bool) {
      if (res == -ECANCELED || res == -EINTR) cancelled++;
      if (!rearm.in_flight && rearm_refused == 0) loop->Read(&rearm, r.get(), buf, 1, 0);
    };
    loop->Read(&c, r.get(), buf, sizeof(buf), 0);
  }
  loop->AddTimer(std::chrono::hours(1), [&] { timer_ran = true; });
  std::thread runner([&] { loop->Run(); });
  // Let the loop start, then queue a post and stop from this thread.
  std::promise<void> started;
  ASSERT_TRUE(loop->Post([&] { started.set_value(); }));
  ASSERT_EQ(started.get_future().wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(loop->running());
  bool queued_post_ran = false;
  ASSERT_TRUE(loop->Post([&] { queued_post_ran = true; }));
  loop->Stop();
  EXPECT_FALSE(loop->running());
  runner.join();
  EXPECT_TRUE(queued_post_ran);
  EXPECT_EQ(cancelled.load(), kReads);
  EXPECT_EQ(rearm_refused.load(), 1);
  EXPECT_FALSE(timer_ran);
  EXPECT_EQ(loop->in_flight(), 0u);
  EXPECT_FALSE(loop->Post([] {}));
}

// A callback that re-arms whatever it is told (a poll that reads again after any ending, as the
// relay's kernel poll) is refused once during a stop, not again and again until the stop's bound
// (which cost every draining fkserve 5 s with its volume unserved).
TEST(LoopTest, ACompletionThatReArmsOnEveryEndingIsRefusedOnceWhileStopping) {
  auto loop_or = Loop::Create();
  ASSERT_TRUE(loop_or.ok()) << loop_or.status();
  std::unique_ptr<Loop> loop = std::move(*loop_or);
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd r(p[0]), w(p[1]);
  std::atomic<int> endings{0};
  Completion poll;
  poll.callback = [&](int32_t, bool more) {
    if (more) return;
    endings++;
    loop->PollAdd(&poll, r.get(), POLLIN, /*multishot=*/true);
  };
  std::promise<void> armed;
  ASSERT_TRUE(loop->Post([&] {
    loop->PollAdd(&poll, r.get(), POLLIN, /*multishot=*/true);
    armed.set_value();
  }));
  std::thread runner([&] { loop->Run(); });
  ASSERT_EQ(armed.get_future().wait_for(kTestDeadline), std::future_status::ready);
  loop->Stop();
  runner.join();
  // Once cancelled by the stop, once refused when armed again; then left alone.
  EXPECT_LE(endings.load(), 2);
  EXPECT_EQ(loop->in_flight(), 0u);
}

TEST(LoopTest, UsesSingleIssuerDeferTaskrunWhereTheKernelHasIt) {
  utsname u;
  ASSERT_EQ(uname(&u), 0);
  int major = 0, minor = 0;
  sscanf(u.release, "%d.%d", &major, &minor);
  if (major < 6 || (major == 6 && minor < 1)) {
    GTEST_SKIP() << "kernel " << u.release << " predates IORING_SETUP_DEFER_TASKRUN (6.1)";
  }
  auto loop = Loop::Create();
  ASSERT_TRUE(loop.ok()) << loop.status();
  // 6.1+ kernels support it; the fallback path is for older ones.
  EXPECT_TRUE((*loop)->uses_defer_taskrun());
}

}  // namespace
}  // namespace fusekeeper

namespace fusekeeper {
namespace {

TEST(LoopWithoutRingTest, WhereIoUringIsRefusedCreateSaysWhyOrWaitsWithEpoll) {
  absl::Status plain;
  std::unique_ptr<Loop> loop = LoopWithoutRing(&plain);
  ASSERT_NE(loop, nullptr) << "seccomp filter or epoll loop";
  EXPECT_TRUE(absl::IsUnavailable(plain)) << plain;
  EXPECT_NE(plain.message().find("seccomp"), std::string::npos) << plain;
  EXPECT_NE(loop->without_ring_why().find("seccomp"), std::string::npos) << loop->without_ring_why();
  std::unique_ptr<Loop> with_ring = std::move(*Loop::Create({.epoll_without_ring = true}));
  EXPECT_EQ(with_ring->without_ring_why(), "") << "where the ring is allowed, it is used";
}

TEST(LoopWithoutRingTest, MultishotPollsAreEdgeTriggeredSingleShotsFireOnceAndCancelEnds) {
  std::unique_ptr<Loop> loop = LoopWithoutRing();
  ASSERT_NE(loop, nullptr);
  LoopThread lt(std::move(loop));
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  // Two completions on one fd, as the relay's program socket has (in, and out when full).
  Completion in, out;
  std::atomic<int> messages{0}, wakeups{0}, outs{0};
  std::promise<int32_t> in_end;
  std::promise<void> got_two, got_three;
  in.callback = [&](int32_t res, bool more) {
    if (!more) {
      in_end.set_value(res);
      return;
    }
    ++wakeups;
    char buf[16];
    const int before = messages;
    while (recv(a.get(), buf, sizeof(buf), MSG_DONTWAIT) > 0) ++messages;
    // Said once drained (EAGAIN seen): what is sent next is news.
    if (before < 2 && messages >= 2) got_two.set_value();
    if (before < 3 && messages >= 3) got_three.set_value();
  };
  out.callback = [&](int32_t res, bool more) {
    EXPECT_FALSE(more);
    EXPECT_TRUE(res & POLLOUT) << res;
    ++outs;
  };
  lt.RunOnLoop([&] {
    lt.loop().PollAdd(&in, a.get(), POLLIN, /*multishot=*/true);
    lt.loop().PollAdd(&out, a.get(), POLLOUT, /*multishot=*/false);
  });
  ASSERT_EQ(send(b.get(), "1", 1, 0), 1);
  ASSERT_EQ(send(b.get(), "2", 1, 0), 1);
  ASSERT_EQ(got_two.get_future().wait_for(kTestDeadline), std::future_status::ready);
  ASSERT_EQ(send(b.get(), "3", 1, 0), 1);
  ASSERT_EQ(got_three.get_future().wait_for(kTestDeadline), std::future_status::ready);
  lt.RunOnLoop([&] {
    EXPECT_EQ(outs.load(), 1) << "a single-shot poll fires once";
    EXPECT_EQ(lt.loop().in_flight(), 1u);
    lt.loop().Cancel(&in);
  });
  auto end = in_end.get_future();
  ASSERT_EQ(end.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(end.get(), -ECANCELED);
  EXPECT_GE(wakeups.load(), 2);
  EXPECT_LE(wakeups.load(), 3) << "drained, a multishot poll fires again only on news";
  lt.RunOnLoop([&] { EXPECT_EQ(lt.loop().in_flight(), 0u); });
}

TEST(LoopWithoutRingTest, TimersPostsAndStopWithPollsInFlight) {
  std::unique_ptr<Loop> loop = LoopWithoutRing();
  ASSERT_NE(loop, nullptr);
  Loop* l = loop.get();
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd r(p[0]), w(p[1]);
  std::vector<Completion> polls(20);
  std::atomic<int> cancelled{0};
  Completion rearming;  // arms itself again whatever it is told, as the relay's kernel poll
  std::atomic<int> rearming_endings{0};
  rearming.callback = [&](int32_t, bool more) {
    if (more) return;
    ++rearming_endings;
    l->PollAdd(&rearming, r.get(), POLLIN, /*multishot=*/true);
  };
  std::promise<void> timer_ran;
  LoopThread lt(std::move(loop));
  lt.RunOnLoop([&] {
    for (auto& c : polls) {
      c.callback = [&](int32_t res, bool more) {
        if (!more && res == -ECANCELED) ++cancelled;
      };
      l->PollAdd(&c, r.get(), POLLIN, /*multishot=*/true);
    }
    l->PollAdd(&rearming, r.get(), POLLIN, /*multishot=*/true);
    l->AddTimer(std::chrono::milliseconds(1), [&] { timer_ran.set_value(); });
    l->AddTimer(std::chrono::hours(1), [] { ADD_FAILURE() << "a timer dropped at stop ran"; });
  });
  ASSERT_EQ(timer_ran.get_future().wait_for(kTestDeadline), std::future_status::ready);
  std::promise<void> posted;
  std::thread([&] { ASSERT_TRUE(l->Post([&] { posted.set_value(); })); }).join();
  ASSERT_EQ(posted.get_future().wait_for(kTestDeadline), std::future_status::ready);
  lt.StopAndJoin();
  EXPECT_EQ(cancelled.load(), 20);
  EXPECT_LE(rearming_endings.load(), 2);
  EXPECT_EQ(l->in_flight(), 0u);
  EXPECT_FALSE(l->Post([] {}));
}

}  // namespace
}  // namespace fusekeeper
