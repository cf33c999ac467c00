// Test helper: a Loop running on its own thread, with a way to run code on it and wait.
#pragma once

#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "agent/loop/loop.h"
#include "tests/testing/running_loop.h"
#include "glog/logging.h"
#include "gtest/gtest.h"

namespace fusekeeper {

// Every wait in the tests has this bound: generous, because it only matters when a test fails.
inline constexpr std::chrono::seconds kTestDeadline{20};

class LoopThread : public RunningLoop {
 public:
  using RunningLoop::RunningLoop;

  // Runs fn on the loop thread and waits for it (bounded by kTestDeadline).
  template <typename F>
  void RunOnLoop(F fn) {
    std::promise<void> done;
    ASSERT_TRUE(loop().Post([&] {
      fn();
      done.set_value();
    }));
    ASSERT_EQ(done.get_future().wait_for(kTestDeadline), std::future_status::ready);
  }
};

}  // namespace fusekeeper
