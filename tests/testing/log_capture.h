// LogCapture: every line glog emits while it is alive, for tests of what the agent logs.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

#include "glog/logging.h"

namespace fusekeeper {

class LogCapture : public google::LogSink {
 public:
  LogCapture() { google::AddLogSink(this); }
  ~LogCapture() override { google::RemoveLogSink(this); }
  void send(google::LogSeverity, const char*, const char*, int, const struct ::tm*, const char* message,
            size_t len) override {
    std::lock_guard<std::mutex> lock(mu_);
    text_.append(message, len).append("\n");
    logged_.notify_all();
  }
  // Until `what` has been logged (woken by each line); false after `timeout`.
  bool WaitFor(const std::string& what, std::chrono::nanoseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return logged_.wait_for(lock, timeout, [&] { return text_.find(what) != std::string::npos; });
  }
  std::string text() {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }
  // How many times `what` occurs in what was logged.
  int Count(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (size_t at = text_.find(what); at != std::string::npos; at = text_.find(what, at + 1)) ++n;
    return n;
  }

 private:
  std::mutex mu_;
  std::condition_variable logged_;
  std::string text_;
};

}  // namespace fusekeeper
