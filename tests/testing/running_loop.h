// A Loop running on a thread of its own, for tests and benchmarks: made (or given), run, and
// stopped and joined when it goes. loop_thread.h adds the tests' bounded waits.
#pragma once

#include <future>
#include <memory>
#include <thread>

#include "agent/loop/loop.h"
#include "glog/logging.h"

namespace fusekeeper {

class RunningLoop {
 public:
  RunningLoop() : RunningLoop(CreateOrDie()) {}
  explicit RunningLoop(std::unique_ptr<Loop> loop) : loop_(std::move(loop)) {
    CHECK(loop_ != nullptr);
    thread_ = std::thread([this] { loop_->Run(); });
  }
  ~RunningLoop() { StopAndJoin(); }
  RunningLoop(const RunningLoop&) = delete;
  RunningLoop& operator=(const RunningLoop&) = delete;

  Loop& loop() { return *loop_; }

  // Runs fn on the loop thread and waits for it, however long it takes (benchmarks).
  template <typename F>
  void RunAndWait(F fn) {
    std::promise<void> done;
    CHECK(loop_->Post([&] {
      fn();
      done.set_value();
    }));
    done.get_future().wait();
  }

  void StopAndJoin() {
    if (!thread_.joinable()) return;
    loop_->Stop();
    thread_.join();
  }

 private:
  static std::unique_ptr<Loop> CreateOrDie() {
    auto loop = Loop::Create();
    CHECK(loop.ok()) << loop.status();
    return std::move(*loop);
  }

  std::unique_ptr<Loop> loop_;
  std::thread thread_;
};

}  // namespace fusekeeper
