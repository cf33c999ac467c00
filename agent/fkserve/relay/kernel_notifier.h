// KernelNotifier: writes a program's notifications (FUSE_NOTIFY_INVAL_ENTRY, INVAL_INODE, DELETE,
// STORE, RETRIEVE...) to the kernel's connection from a thread of its own, never from the relay's
// loop.
//
// Why: the kernel acts on a notification in the writing thread and takes locks to do it —
// INVAL_ENTRY and DELETE lock the directory's inode. A request in flight may hold that very lock
// while it waits for its answer (a RENAME holds both directories' locks), and the answer is the
// relay loop's to deliver: a loop that wrote the notification itself would wait for the lock, the
// request for the loop, forever (seen: rclone's INVAL_ENTRY during a rename in the model-checking
// writer; fk-loop asleep in fuse_reverse_inval_entry, the app's rename in request_wait_answer).
// libfuse says the same to its servers: never notify from the thread that answers. Notifications
// are hints whose order against answers the kernel does not rely on.
//
// Thread-safe: Push from any thread (the loop's). Bounded: past kMaxQueued messages a notification
// is dropped with a log line (the kernel's caches then expire by their timeouts).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "agent/base/unique_fd.h"

namespace fusekeeper::relay {

class KernelNotifier {
 public:
  static constexpr size_t kMaxQueued = 4096;

  // Takes a dup of `kernel_fd`; `log` may be called from the notifier's thread.
  KernelNotifier(int kernel_fd, std::function<void(const std::string&)> log);
  // Does not wait for a write in progress (it may wait on the kernel for as long as a request
  // holds a lock): the thread ends by itself once it is done, closing its dup.
  ~KernelNotifier();

  void Push(const char* data, size_t len);

 private:
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::string> queue;
    bool stopping = false;
    UniqueFd fd;
    std::function<void(const std::string&)> log;
  };
  std::shared_ptr<Shared> shared_;
  bool dropped_logged_ = false;
};

}  // namespace fusekeeper::relay
