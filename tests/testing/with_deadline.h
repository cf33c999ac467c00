// Test helper: runs something that may hang (a read of a FUSE mount nobody serves) on a thread of
// its own, and gives up waiting for it after a deadline.
#pragma once

#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <thread>

#include "tests/testing/loop_thread.h"

namespace fusekeeper {

// Runs fn on another thread; returns its result, or nullopt if it does not finish in time.
template <typename F>
auto WithDeadline(F fn, std::chrono::milliseconds limit = std::chrono::milliseconds(kTestDeadline))
    -> std::optional<decltype(fn())> {
  auto task = std::make_shared<std::packaged_task<decltype(fn())()>>(std::move(fn));
  auto f = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (f.wait_for(limit) != std::future_status::ready) return std::nullopt;
  return f.get();
}

}  // namespace fusekeeper
