// Loop: the agent's single-threaded io_uring event loop.
//
// Everything that waits in the agent waits here: ring operations (reads, polls, accepts, statx,
// sendmsg...) whose results come back as Completions, timers, work posted from other threads
// (gRPC handlers, the BlockingPool) and signals (SignalWatcher).
//
// Threading: Create() may run on any thread. Until Run() starts, the creating thread may also set
// up timers and ring operations. Run() binds the loop to the calling thread; from then on every
// method except Post(), Stop(), IsLoopThread() and running() must be called on that thread
// (they CHECK it). Nothing on the loop thread may block: no mount syscalls, no stat of a FUSE
// mount point, no blocking socket I/O. Use the ring or the BlockingPool.
//
// Kernel features: the ring is set up with IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN (6.1+)
// and R_DISABLED so it can be created on one thread and run on another; on older kernels (EINVAL)
// it falls back to a plain ring (5.10+ for the opcodes used here).
#pragma once

#include <liburing.h>
#include <stdint.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"

namespace fusekeeper {

// One ring operation in flight. Owned by the caller, who keeps it at a fixed address (and keeps
// alive any buffers, iovecs or msghdrs the operation points to) until its callback has run for
// the last time: once for a single-shot operation, until a call with more == false for a
// multishot one. The callback runs on the loop thread with the CQE's res (>= 0 or -errno).
// A cancelled operation completes with -ECANCELED (or -EINTR/-ENOENT for some opcodes).
struct Completion {
  absl::AnyInvocable<void(int32_t res, bool more)> callback;
  // Loop-private bookkeeping.
  bool in_flight = false;
};

struct LoopOptions {
  unsigned ring_entries = 256;
  // Where io_uring is refused (a container runtime's default seccomp profile, the
  // kernel.io_uring_disabled sysctl), wait with epoll instead of failing. Such a loop offers
  // PollAdd, Cancel, timers and posts only: Read and GetSqe/Arm need the ring (they CHECK).
  bool epoll_without_ring = false;
  // Non-empty: wait with epoll even where io_uring is allowed, for this reason (without_ring_why).
  // For a process whose sockets must close the moment it dies: a ring's polls hold their files
  // until the ring's teardown, which the kernel runs later, in a worker (so a peer would see a
  // killed process's socket close late).
  std::string epoll_only;
};

using TimerId = uint64_t;
using LoopClock = std::chrono::steady_clock;

class Loop {
 public:
  // Sets up the ring. Fails with a message saying what to do when io_uring is unavailable
  // (kernel.io_uring_disabled, seccomp, old kernel, RLIMIT_MEMLOCK).
  static absl::StatusOr<std::unique_ptr<Loop>> Create(const LoopOptions& options = {});

  ~Loop();
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  // Runs until Stop(). On stop: in-flight ring operations are cancelled and their callbacks run
  // (with a cancellation result), posted work queued before the stop is run, pending timers are
  // dropped without running, then Run() returns. Blocks the calling thread (it is the loop).
  void Run();

  // Any thread. Asks Run() to wind down as described above; idempotent.
  void Stop();

  // Any thread. Queues fn to run on the loop thread, in order with other posts. Returns false
  // (fn is destroyed without running) once the loop has finished stopping.
  bool Post(absl::AnyInvocable<void()> fn);

  // Any thread.
  bool IsLoopThread() const;
  // Any thread: true from the moment Run() starts until Stop() is requested.
  bool running() const { return running_.load(std::memory_order_acquire); }
  // Any thread: Stop() was requested (false before Run() starts).
  bool stop_requested() const { return stop_requested_.load(std::memory_order_acquire); }
  // Run has returned: no callback of this loop runs any more, and Post refuses. Any thread.
  bool finished() const { return finished_.load(std::memory_order_acquire); }
  // Any thread: how long the loop has been running callbacks without returning to wait on the
  // ring (zero while it waits). A loop stuck in one callback shows here, so health checks can
  // answer off the loop thread and still notice a wedged loop.
  std::chrono::nanoseconds busy_for() const;

  // ---- Loop thread only (or the creating thread before Run) ----

  // Returns a zeroed SQE, submitting queued ones first if the submission queue is full.
  io_uring_sqe* GetSqe();
  // Attaches completion to sqe (which the caller has prepared). While the loop is stopping the
  // operation is not submitted; the callback runs with -ECANCELED instead, once per completion
  // and stop (armed again from that callback, it is dropped).
  void Arm(io_uring_sqe* sqe, Completion* completion);
  // Asks the kernel to cancel completion's operation. Its callback still runs (once, or with
  // more == false for multishot), normally with -ECANCELED.
  void Cancel(Completion* completion);

  // Convenience wrappers around GetSqe + prep + Arm.
  void Read(Completion* c, int fd, void* buf, unsigned len, uint64_t offset);
  void PollAdd(Completion* c, int fd, unsigned poll_mask, bool multishot);

  // Runs fn after delay on the loop thread. Timers are dropped (not run) at Stop.
  TimerId AddTimer(std::chrono::nanoseconds delay, absl::AnyInvocable<void()> fn);
  // Returns false if the timer already ran or was cancelled.
  bool CancelTimer(TimerId id);

  // Number of ring operations in flight (loop thread).
  size_t in_flight() const { return in_flight_; }
  // Iterations of the loop so far (for tests and metrics).
  uint64_t iterations() const { return iterations_; }
  // Whether the ring uses SINGLE_ISSUER|DEFER_TASKRUN.
  bool uses_defer_taskrun() const { return defer_taskrun_; }
  // Why this loop waits with epoll (LoopOptions::epoll_without_ring); empty when it has a ring.
  const std::string& without_ring_why() const { return without_ring_why_; }

 private:
  Loop() = default;

  void AssertLoopThread() const;
  void RunExpiredTimers();
  bool RunPosted();  // returns true if more posts are queued
  void ReapCompletions();
  void BeginStopping();
  void ArmWakeRead();
  void FinishStopping();
  // Its last callback is next: no longer in flight.
  void Finished(Completion* completion);
  // While stopping: `completion`'s callback runs with -ECANCELED, never submitted (once per stop).
  void Refuse(Completion* completion);
  // The epoll backend: each PollAdd watches a dup of its fd (so one fd may carry several
  // completions, as on the ring); a multishot one is edge-triggered (news only, as a multishot
  // ring poll), a single-shot one EPOLLONESHOT.
  bool epoll_mode() const { return epoll_fd_.valid(); }
  absl::Status SetUpEpoll();
  void EpollAdd(Completion* c, int fd, unsigned poll_mask, bool multishot);
  void EpollForget(Completion* c);
  void EpollWait(int timeout_ms);

  io_uring ring_{};
  bool ring_ready_ = false;
  bool defer_taskrun_ = false;
  UniqueFd wake_fd_;
  uint64_t wake_buf_ = 0;
  Completion wake_completion_;

  std::atomic<bool> running_{false};
  // LoopClock nanoseconds since epoch when the loop last woke; 0 while it waits.
  std::atomic<int64_t> busy_since_ns_{0};
  std::atomic<bool> stop_requested_{false};
  std::atomic<std::thread::id> loop_thread_{};
  std::atomic<bool> finished_{false};  // Run has returned (set last, as it ends)
  bool stopping_ = false;
  size_t in_flight_ = 0;
  uint64_t iterations_ = 0;
  // Completions armed while stopping: their callbacks run with -ECANCELED, never submitted.
  std::vector<Completion*> refused_;
  // Those refused during this stop: armed again, they are left alone (not in flight, not called).
  std::unordered_set<Completion*> refused_once_;
  // All armed completions, for one-by-one cancellation where CANCEL_ANY is unsupported.
  std::unordered_set<Completion*> armed_;

  struct EpollWatch {
    uint64_t id;
    UniqueFd fd;
    bool multishot;
  };
  UniqueFd epoll_fd_;
  std::string without_ring_why_;
  uint64_t next_watch_id_ = 1;  // 0 is the wake eventfd
  std::unordered_map<Completion*, EpollWatch> watches_;
  std::unordered_map<uint64_t, Completion*> watch_ids_;
  // Watches ended without an event (cancelled, or refused by epoll_ctl): callbacks to run.
  std::vector<std::pair<Completion*, int32_t>> epoll_ended_;

  std::mutex post_mu_;
  std::vector<absl::AnyInvocable<void()>> posted_;  // guarded by post_mu_
  bool post_closed_ = false;                         // guarded by post_mu_
  std::atomic<bool> wake_pending_{false};

  struct Timer {
    LoopClock::time_point deadline;
    absl::AnyInvocable<void()> fn;
  };
  TimerId next_timer_id_ = 1;
  std::multimap<LoopClock::time_point, TimerId> timer_queue_;
  std::unordered_map<TimerId, Timer> timers_;
};

}  // namespace fusekeeper
