// Loop benchmarks: what a hop onto the loop thread costs, next to the classic alternative.
//
//   bazel run -c opt //bench:loop_bench -- --benchmark_repetitions=10 \
//       --benchmark_report_aggregates_only=true
//
// Every waiter blocks (absl::Notification, a futex) as a gRPC thread would; spinning waiters
// distort results on a 2-core machine. BM_LoopPostRoundTrip: another thread Posts a callback and
// waits until it has run (eventfd wake through the ring). BM_CondvarRoundTrip is the baseline: the same hand-off to a worker thread
// with a mutex + condition variable. BM_LoopPostBurst: throughput of 1000 posts per wake.
// BM_PoolRoundTrip: BlockingPool work item → completion back on the loop.
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/synchronization/notification.h"
#include "agent/loop/blocking_pool.h"
#include "agent/loop/loop.h"
#include "absl/synchronization/mutex.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"
#include "tests/testing/running_loop.h"

namespace fusekeeper {
namespace {

void BM_LoopPostRoundTrip(benchmark::State& state) {
  RunningLoop rl;
  for (auto _ : state) {
    absl::Notification done;
    rl.loop().Post([&] { done.Notify(); });
    done.WaitForNotification();
  }
}
BENCHMARK(BM_LoopPostRoundTrip)->UseRealTime();

// Baseline: a worker thread fed through a mutex-protected queue and a condition variable.
void BM_CondvarRoundTrip(benchmark::State& state) {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool stop = false;
  std::thread worker([&] {
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;
      auto fn = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
  });
  for (auto _ : state) {
    absl::Notification done;
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back([&] { done.Notify(); });
    }
    cv.notify_one();
    done.WaitForNotification();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_one();
  worker.join();
}
BENCHMARK(BM_CondvarRoundTrip)->UseRealTime();

void BM_LoopPostBurst(benchmark::State& state) {
  RunningLoop rl;
  const int burst = static_cast<int>(state.range(0));
  std::atomic<int> ran{0};
  for (auto _ : state) {
    ran.store(0, std::memory_order_relaxed);
    absl::Notification done;
    for (int i = 0; i < burst; ++i) {
      rl.loop().Post([&] {
        if (ran.fetch_add(1, std::memory_order_relaxed) + 1 == burst) done.Notify();
      });
    }
    done.WaitForNotification();
  }
  state.SetItemsProcessed(state.iterations() * burst);
}
BENCHMARK(BM_LoopPostBurst)->Arg(1000)->UseRealTime();

void BM_PoolRoundTrip(benchmark::State& state) {
  RunningLoop rl;
  BlockingPool pool(rl.loop(), {.threads = 1, .max_queued = 16});
  for (auto _ : state) {
    absl::Notification done;
    CHECK(pool.Submit("bench", [] {}, [&](absl::Status) { done.Notify(); }).ok());
    done.WaitForNotification();
  }
  pool.Shutdown(absl::Seconds(5));
}
BENCHMARK(BM_PoolRoundTrip)->UseRealTime();

// As the agent's main() does: Debian's abseil has absl::Mutex deadlock detection on by default.
const bool kNoDeadlockDetection = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

}  // namespace
}  // namespace fusekeeper
