// BlockingPool: a small, bounded set of threads for syscalls io_uring cannot do (mount, umount2,
// fsconfig, move_mount, open_tree, statfs with a deadline...). Work runs on a pool thread; its
// completion runs back on the loop thread via Loop::Post.
//
// Every submission names its reason (e.g. "mount", "umount") so that stuck or slow work can be
// attributed. The queue is bounded: when it is full, Submit fails at once instead of growing.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/loop/loop.h"

namespace fusekeeper {

struct BlockingPoolOptions {
  int threads = 4;           // always running
  // Elastic pools: when every worker is busy and work is waiting, another worker is started, up
  // to this many in all; extra workers exit after idle_exit of idleness. For work that may hang
  // indefinitely (statfs on a dead FUSE server), so that hung items cannot starve healthy ones.
  int max_threads = 0;       // 0: same as threads (a fixed pool)
  absl::Duration idle_exit = absl::Seconds(30);
  size_t max_queued = 1024;
};

class BlockingPool {
 public:
  // The loop must outlive the pool.
  BlockingPool(Loop& loop, const BlockingPoolOptions& options);
  // Shuts down (see Shutdown) with no grace: threads still blocked in a syscall are detached.
  ~BlockingPool();
  BlockingPool(const BlockingPool&) = delete;
  BlockingPool& operator=(const BlockingPool&) = delete;

  // Any thread. Queues work; when it has run, done(OkStatus) runs on the loop thread. If the pool
  // shuts down before work starts, done(CancelledError) runs on the loop thread instead (provided
  // the loop still accepts posts). Returns ResourceExhausted when max_queued items are waiting and
  // FailedPrecondition after shutdown began; in those cases neither work nor done ever runs.
  absl::Status Submit(std::string reason, absl::AnyInvocable<void()> work,
                      absl::AnyInvocable<void(absl::Status)> done);

  // Typed convenience: work's result is handed to done on the loop thread.
  template <typename T>
  absl::Status Run(std::string reason, absl::AnyInvocable<T()> work,
                   absl::AnyInvocable<void(absl::StatusOr<T>)> done);

  // Any thread, non-blocking. Stops taking work and cancels what has not started.
  void BeginShutdown();
  // Not on the loop thread (it blocks). BeginShutdown, then waits up to grace for running work;
  // threads still busy after that (a syscall hung on a dead FUSE server) are detached and named
  // in the log. Returns the number of threads abandoned.
  int Shutdown(absl::Duration grace);

  // Any thread: work submitted whose done has not yet been posted.
  size_t outstanding() const;

 private:
  struct Item {
    std::string reason;
    absl::AnyInvocable<void()> work;
    absl::AnyInvocable<void(absl::Status)> done;
  };
  // Shared with the workers so that a worker abandoned in a hung syscall never touches a
  // destroyed pool; once `closed`, it finishes without posting to the (possibly gone) loop.
  struct State {
    Loop* loop;
    size_t max_queued;
    int min_threads;
    int max_threads;
    absl::Duration idle_exit;
    std::mutex mu;
    std::condition_variable cv;       // workers wait for items
    std::condition_variable idle_cv;  // Shutdown waits for running work
    std::deque<Item> queue;           // guarded by mu
    std::map<int, std::string> running_reason;  // by worker id, "" when idle; guarded by mu
    int workers = 0;                  // guarded by mu: started and not yet exited
    int idle_workers = 0;             // guarded by mu
    int next_worker_id = 0;           // guarded by mu
    size_t outstanding = 0;           // guarded by mu
    bool shutting_down = false;       // guarded by mu
    bool closed = false;              // guarded by mu: Shutdown returned
  };
  static void Worker(std::shared_ptr<State> state, int id, bool elastic);

  Loop& loop_;
  std::shared_ptr<State> state_;
  std::vector<std::thread> threads_;
};

template <typename T>
absl::Status BlockingPool::Run(std::string reason, absl::AnyInvocable<T()> work,
                               absl::AnyInvocable<void(absl::StatusOr<T>)> done) {
  struct Shared {
    absl::AnyInvocable<T()> work;
    absl::StatusOr<T> result = absl::UnknownError("not run");
  };
  auto shared = std::make_shared<Shared>();
  shared->work = std::move(work);
  return Submit(
      std::move(reason), [shared] { shared->result = shared->work(); },
      [shared, done = std::move(done)](absl::Status status) mutable {
        if (!status.ok()) {
          done(status);
        } else {
          done(std::move(shared->result));
        }
      });
}

}  // namespace fusekeeper
