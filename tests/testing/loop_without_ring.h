// A Loop made where io_uring is refused: on a thread under the runtimes' default seccomp filter
// (no_io_uring.h), so it waits with epoll (LoopOptions::epoll_without_ring). The filter stays
// with that thread alone.
#pragma once

#include <memory>
#include <thread>

#include "absl/status/status.h"
#include "agent/loop/loop.h"
#include "tests/testing/no_io_uring.h"

namespace fusekeeper {

// nullptr if the filter could not be installed. `plain_create`: what a Create without the
// epoll fallback said there.
inline std::unique_ptr<Loop> LoopWithoutRing(absl::Status* plain_create = nullptr) {
  std::unique_ptr<Loop> out;
  std::thread([&] {
    if (!RefuseIoUring()) return;
    if (plain_create != nullptr) *plain_create = Loop::Create().status();
    auto l = Loop::Create({.epoll_without_ring = true});
    if (l.ok()) out = std::move(*l);
  }).join();
  return out;
}

}  // namespace fusekeeper
