// Test helper: a Loop running on its own thread, with a way to run code on it and wait.
#pragma once

#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "agent/loop/loop.h"
#include "glog/logging.h"
#include "gtest/gtest.h"

namespace fusekeeper {

// Every wait in the tests has this bound: generous, because it only matters when a test fails.
inline constexpr std::chrono::seconds kTestDeadline{20};

class LoopThread {
 public:
  LoopThread() {
    auto loop = Loop::Create();
    CHECK(loop.ok()) << loop.status();
    loop_ = std::move(*loop);
    thread_ = std::thread([this] { loop_->Run(); });
  }
  explicit LoopThread(std::unique_ptr<Loop> loop) : loop_(std::move(loop)) {
    CHECK(loop_ != nullptr);
    thread_ = std::thread([this] { loop_->Run(); });
  }
  ~LoopThread() { StopAndJoin(); }

  Loop& loop() { return *loop_; }

  // Runs fn on the loop thread and waits for it (bounded by kTestDeadline).
  template <typename F>
  void RunOnLoop(F fn) {
    std::promise<void> done;
    ASSERT_TRUE(loop_->Post([&] {
      fn();
      done.set_value();
    }));
    ASSERT_EQ(done.get_future().wait_for(kTestDeadline), std::future_status::ready);
  }

  void StopAndJoin() {
    if (!thread_.joinable()) return;
    loop_->Stop();
    thread_.join();
  }

 private:
  std::unique_ptr<Loop> loop_;
  std::thread thread_;
};

}  // namespace fusekeeper
