#include "agent/loop/loop.h"

#include <errno.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

// How long Run() waits at Stop for cancelled operations to report back before giving up on them.
constexpr std::chrono::seconds kStopCancelBound{5};

std::string ReadSysctl(const char* path) {
  std::ifstream in(path);
  std::string value;
  if (!(in >> value)) return "";
  return value;
}

// Says why io_uring_setup failed and what the operator can do about it.
absl::Status RingUnavailable(int err) {
  const std::string disabled = ReadSysctl("/proc/sys/kernel/io_uring_disabled");
  std::string why;
  if (disabled == "2") {
    why = "io_uring is disabled on this host (sysctl kernel.io_uring_disabled=2). fusekeeper "
          "needs it: set `sysctl -w kernel.io_uring_disabled=0` (or 1 and run the agent "
          "privileged/CAP_SYS_ADMIN or in kernel.io_uring_group).";
  } else if (disabled == "1" && (err == EPERM || err == EACCES)) {
    why = "io_uring is restricted on this host (sysctl kernel.io_uring_disabled=1): only "
          "privileged processes or members of kernel.io_uring_group may use it. Run the agent "
          "container privileged, or set `sysctl -w kernel.io_uring_disabled=0`.";
  } else if (err == EPERM || err == EACCES || err == ENOSYS) {
    why = "io_uring_setup was refused. The usual cause is a seccomp profile (the container "
          "runtime's default profile blocks io_uring): run the agent with "
          "`securityContext.seccompProfile.type: Unconfined` (it is privileged anyway). "
          "On kernels built without CONFIG_IO_URING (ENOSYS) use a kernel with io_uring.";
  } else if (err == ENOMEM) {
    why = "io_uring_setup ran out of locked memory: raise RLIMIT_MEMLOCK (ulimit -l) or use "
          "a kernel >= 5.12, which accounts rings to memory cgroups instead.";
  } else {
    why = "io_uring_setup failed.";
  }
  return absl::UnavailableError(absl::StrCat("io_uring unavailable: ", std::strerror(err),
                                             " (errno ", err, "). ", why));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Loop>> Loop::Create(const LoopOptions& options) {
  std::unique_ptr<Loop> loop(new Loop());
  io_uring_params params{};
  params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_R_DISABLED;
  int r = !options.epoll_only.empty() ? -ECANCELED
                                      : io_uring_queue_init_params(options.ring_entries, &loop->ring_, &params);
  if (r == -EINVAL) {
    // Kernel older than 6.1: a plain ring, which any thread may submit to.
    params = {};
    r = io_uring_queue_init_params(options.ring_entries, &loop->ring_, &params);
  } else if (r == 0) {
    loop->defer_taskrun_ = true;
  }
  if (r < 0 && !options.epoll_without_ring && options.epoll_only.empty()) return RingUnavailable(-r);
  if (!options.epoll_only.empty()) {
    loop->without_ring_why_ = options.epoll_only;
  } else if (r < 0) {
    loop->without_ring_why_ = absl::StrCat("io_uring_setup: ", std::strerror(-r));
    if (-r == EPERM || -r == EACCES || -r == ENOSYS) {
      absl::StrAppend(&loop->without_ring_why_, " (a seccomp profile, as container runtimes' default, or "
                                                "kernel.io_uring_disabled)");
    }
  } else {
    loop->ring_ready_ = true;
  }

  int efd = eventfd(0, EFD_CLOEXEC);
  if (efd < 0) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  loop->wake_fd_.Reset(efd);
  if (!loop->ring_ready_) {
    if (absl::Status s = loop->SetUpEpoll(); !s.ok()) return s;
  }
  Loop* self = loop.get();
  loop->wake_completion_.callback = [self](int32_t res, bool /*more*/) {
    self->wake_pending_.store(false, std::memory_order_release);
    if (res >= 0 && !self->stopping_) self->ArmWakeRead();
  };
  return loop;
}

Loop::~Loop() {
  if (ring_ready_) io_uring_queue_exit(&ring_);
}

bool Loop::IsLoopThread() const {
  return loop_thread_.load(std::memory_order_acquire) == std::this_thread::get_id();
}

void Loop::AssertLoopThread() const {
  // Before Run() the creating thread sets things up; afterwards only the loop thread may, until
  // Run has finished: then whoever owns the loop (its owners' destructors cancel their timers).
  const std::thread::id owner = loop_thread_.load(std::memory_order_acquire);
  CHECK(owner == std::thread::id() || owner == std::this_thread::get_id() ||
        finished_.load(std::memory_order_acquire))
      << "Loop method called off the loop thread";
}

io_uring_sqe* Loop::GetSqe() {
  AssertLoopThread();
  CHECK(!epoll_mode()) << "this loop has no ring (" << without_ring_why_
                       << "): it offers PollAdd, Cancel, timers and posts only";
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {
    // Submission queue full: hand what we have to the kernel, then there is room.
    CHECK(loop_thread_.load() != std::thread::id())
        << "more than ring_entries operations queued before Run()";
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
    CHECK(sqe != nullptr);
  }
  return sqe;
}

void Loop::Arm(io_uring_sqe* sqe, Completion* completion) {
  AssertLoopThread();
  CHECK(!completion->in_flight) << "Completion armed twice";
  if (stopping_) {
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data(sqe, nullptr);
    Refuse(completion);
    return;
  }
  completion->in_flight = true;
  io_uring_sqe_set_data(sqe, completion);
  ++in_flight_;
  armed_.insert(completion);
}

void Loop::Finished(Completion* completion) {
  completion->in_flight = false;
  --in_flight_;
  armed_.erase(completion);
}

void Loop::Refuse(Completion* completion) {
  // Refused once per stop: a callback that arms again whatever it is told would otherwise be
  // called and re-armed until the stop's bound.
  if (!refused_once_.insert(completion).second) return;
  completion->in_flight = true;
  refused_.push_back(completion);
}

void Loop::Cancel(Completion* completion) {
  AssertLoopThread();
  if (!completion->in_flight || armed_.count(completion) == 0) return;
  if (epoll_mode()) {
    if (watches_.count(completion) == 0) return;  // ended already; its callback is queued
    EpollForget(completion);
    epoll_ended_.emplace_back(completion, -ECANCELED);
    return;
  }
  io_uring_sqe* sqe = GetSqe();
  io_uring_prep_cancel64(sqe, reinterpret_cast<uint64_t>(completion), 0);
  io_uring_sqe_set_data(sqe, nullptr);
}

void Loop::Read(Completion* c, int fd, void* buf, unsigned len, uint64_t offset) {
  io_uring_sqe* sqe = GetSqe();
  io_uring_prep_read(sqe, fd, buf, len, offset);
  Arm(sqe, c);
}

void Loop::PollAdd(Completion* c, int fd, unsigned poll_mask, bool multishot) {
  if (epoll_mode()) return EpollAdd(c, fd, poll_mask, multishot);
  io_uring_sqe* sqe = GetSqe();
  if (multishot) {
    io_uring_prep_poll_multishot(sqe, fd, poll_mask);
  } else {
    io_uring_prep_poll_add(sqe, fd, poll_mask);
  }
  Arm(sqe, c);
}

void Loop::ArmWakeRead() {
  if (epoll_mode()) return;  // the eventfd is watched for good (SetUpEpoll)
  Read(&wake_completion_, wake_fd_.get(), &wake_buf_, sizeof(wake_buf_), 0);
}

absl::Status Loop::SetUpEpoll() {
  epoll_fd_.Reset(epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_fd_.valid()) return absl::InternalError(absl::StrCat("epoll_create1: ", std::strerror(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, wake_fd_.get(), &ev) != 0) {
    return absl::InternalError(absl::StrCat("epoll_ctl of the wake eventfd: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void Loop::EpollAdd(Completion* c, int fd, unsigned poll_mask, bool multishot) {
  AssertLoopThread();
  CHECK(!c->in_flight) << "Completion armed twice";
  if (stopping_) return Refuse(c);
  c->in_flight = true;
  ++in_flight_;
  armed_.insert(c);
  UniqueFd dup(fcntl(fd, F_DUPFD_CLOEXEC, 3));
  if (!dup.valid()) {
    epoll_ended_.emplace_back(c, -errno);
    return;
  }
  const uint64_t id = next_watch_id_++;
  epoll_event ev{};
  ev.events = poll_mask | (multishot ? EPOLLET : EPOLLONESHOT);
  ev.data.u64 = id;
  if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, dup.get(), &ev) != 0) {
    epoll_ended_.emplace_back(c, -errno);
    return;
  }
  watch_ids_.emplace(id, c);
  watches_.emplace(c, EpollWatch{id, std::move(dup), multishot});
}

void Loop::EpollForget(Completion* c) {
  auto it = watches_.find(c);
  if (it == watches_.end()) return;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, it->second.fd.get(), nullptr);
  watch_ids_.erase(it->second.id);
  watches_.erase(it);  // closes the dup
}

void Loop::EpollWait(int timeout_ms) {
  if (!epoll_ended_.empty()) timeout_ms = 0;
  epoll_event events[64];
  busy_since_ns_.store(0, std::memory_order_relaxed);
  const int n = epoll_wait(epoll_fd_.get(), events, 64, timeout_ms);
  busy_since_ns_.store(LoopClock::now().time_since_epoch().count(), std::memory_order_relaxed);
  if (n < 0 && errno != EINTR) LOG(ERROR) << "epoll_wait failed: " << std::strerror(errno);
  for (int i = 0; i < n; ++i) {
    const uint64_t id = events[i].data.u64;
    if (id == 0) {
      uint64_t count;
      ssize_t r = ::read(wake_fd_.get(), &count, sizeof(count));
      (void)r;
      wake_pending_.store(false, std::memory_order_release);
      continue;
    }
    // A callback earlier in this batch may have cancelled (or re-armed under a new id) this one.
    auto it = watch_ids_.find(id);
    if (it == watch_ids_.end()) continue;
    Completion* c = it->second;
    const bool more = watches_.at(c).multishot;
    if (!more) {
      EpollForget(c);
      Finished(c);
    }
    // EPOLLIN, EPOLLOUT, EPOLLERR, EPOLLHUP... have poll(2)'s values, as a ring poll's result.
    c->callback(static_cast<int32_t>(events[i].events & ~(EPOLLET | EPOLLONESHOT)), more);
  }
  std::vector<std::pair<Completion*, int32_t>> ended;
  ended.swap(epoll_ended_);
  for (auto& [c, res] : ended) {
    Finished(c);
    c->callback(res, false);
  }
}

TimerId Loop::AddTimer(std::chrono::nanoseconds delay, absl::AnyInvocable<void()> fn) {
  AssertLoopThread();
  const TimerId id = next_timer_id_++;
  if (stopping_) return id;  // dropped: the loop is winding down
  const LoopClock::time_point deadline = LoopClock::now() + delay;
  timer_queue_.emplace(deadline, id);
  timers_.emplace(id, Timer{deadline, std::move(fn)});
  return id;
}

bool Loop::CancelTimer(TimerId id) {
  AssertLoopThread();
  auto it = timers_.find(id);
  if (it == timers_.end()) return false;
  auto range = timer_queue_.equal_range(it->second.deadline);
  for (auto q = range.first; q != range.second; ++q) {
    if (q->second == id) {
      timer_queue_.erase(q);
      break;
    }
  }
  timers_.erase(it);
  return true;
}

void Loop::RunExpiredTimers() {
  const LoopClock::time_point now = LoopClock::now();
  // Timers added by the callbacks below wait for the next iteration, so a timer that re-adds
  // itself with zero delay cannot starve the ring.
  const TimerId first_new_id = next_timer_id_;
  auto q = timer_queue_.begin();
  while (q != timer_queue_.end() && q->first <= now) {
    const TimerId id = q->second;
    if (id >= first_new_id) {
      ++q;
      continue;
    }
    timer_queue_.erase(q);
    auto it = timers_.find(id);
    absl::AnyInvocable<void()> fn = std::move(it->second.fn);
    timers_.erase(it);
    fn();
    q = timer_queue_.begin();
  }
}

bool Loop::Post(absl::AnyInvocable<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    if (post_closed_) return false;
    posted_.push_back(std::move(fn));
  }
  // The loop thread drains posts before it waits again, so only other threads need to wake it.
  if (!IsLoopThread() && !wake_pending_.exchange(true, std::memory_order_acq_rel)) {
    const uint64_t one = 1;
    ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
    (void)n;  // an eventfd write can only fail on counter overflow, which still wakes the ring
  }
  return true;
}

bool Loop::RunPosted() {
  std::vector<absl::AnyInvocable<void()>> batch;
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    batch.swap(posted_);
  }
  for (auto& fn : batch) fn();
  std::lock_guard<std::mutex> lock(post_mu_);
  return !posted_.empty();
}

std::chrono::nanoseconds Loop::busy_for() const {
  const int64_t since = busy_since_ns_.load(std::memory_order_relaxed);
  if (since == 0) return std::chrono::nanoseconds(0);
  return std::max(std::chrono::nanoseconds(0),
                  LoopClock::now() - LoopClock::time_point(LoopClock::duration(since)));
}

void Loop::Stop() {
  running_.store(false, std::memory_order_release);
  if (stop_requested_.exchange(true, std::memory_order_acq_rel)) return;
  if (!IsLoopThread()) {
    const uint64_t one = 1;
    ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
    (void)n;
  }
}

void Loop::BeginStopping() {
  stopping_ = true;
  running_.store(false, std::memory_order_release);
  timer_queue_.clear();
  timers_.clear();
  if (epoll_mode()) {
    const std::vector<Completion*> armed(armed_.begin(), armed_.end());
    for (Completion* c : armed) Cancel(c);
    return;
  }
  // One cancel per operation (rather than IORING_ASYNC_CANCEL_ANY, 5.19+) works on every
  // kernel with io_uring and costs O(in flight) once per process lifetime.
  for (Completion* c : armed_) {
    io_uring_sqe* sqe = GetSqe();
    io_uring_prep_cancel64(sqe, reinterpret_cast<uint64_t>(c), 0);
    io_uring_sqe_set_data(sqe, nullptr);
  }
}

void Loop::ReapCompletions() {
  struct Done {
    Completion* completion;
    int32_t res;
    bool more;
  };
  std::vector<Done> batch;
  unsigned head;
  unsigned seen = 0;
  io_uring_cqe* cqe;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    ++seen;
    // user_data 0 marks our own cancel/nop requests; LIBURING_UDATA_TIMEOUT liburing's internal
    // wait timeout on kernels without EXT_ARG.
    if (cqe->user_data == 0 || cqe->user_data == LIBURING_UDATA_TIMEOUT) continue;
    auto* c = static_cast<Completion*>(io_uring_cqe_get_data(cqe));
    batch.push_back(Done{c, cqe->res, (cqe->flags & IORING_CQE_F_MORE) != 0});
  }
  io_uring_cq_advance(&ring_, seen);
  // Callbacks run after the CQ is released, never from inside the reap.
  for (Done& d : batch) {
    if (!d.more) Finished(d.completion);
    d.completion->callback(d.res, d.more);
  }
}

void Loop::Run() {
  CHECK(loop_thread_.load() == std::thread::id()) << "Loop::Run called twice";
  loop_thread_.store(std::this_thread::get_id(), std::memory_order_release);
  pthread_setname_np(pthread_self(), "fk-loop");
  if (defer_taskrun_) {
    // io_uring_enable_rings() is declared by liburing 2.3 but missing from Debian's .so.
    long r = syscall(__NR_io_uring_register, ring_.ring_fd, IORING_REGISTER_ENABLE_RINGS, nullptr, 0);
    CHECK_EQ(r, 0) << "IORING_REGISTER_ENABLE_RINGS: " << std::strerror(errno);
  }
  if (!stop_requested_.load()) running_.store(true, std::memory_order_release);
  busy_since_ns_.store(LoopClock::now().time_since_epoch().count(), std::memory_order_relaxed);
  ArmWakeRead();

  LoopClock::time_point stop_deadline{};
  while (true) {
    ++iterations_;
    RunExpiredTimers();
    bool more_posts = RunPosted();
    if (stop_requested_.load(std::memory_order_acquire) && !stopping_) {
      BeginStopping();
      stop_deadline = LoopClock::now() + kStopCancelBound;
    }
    if (stopping_) {
      std::vector<Completion*> refused;
      refused.swap(refused_);
      for (Completion* c : refused) {
        c->in_flight = false;
        c->callback(-ECANCELED, false);
      }
      if (in_flight_ == 0 && refused_.empty()) break;
      if (LoopClock::now() >= stop_deadline) {
        LOG(WARNING) << in_flight_ << " ring operations did not finish cancelling within "
                     << kStopCancelBound.count() << "s of stop; abandoning them";
        break;
      }
    }

    __kernel_timespec ts{};
    __kernel_timespec* timeout = nullptr;
    if (more_posts || !refused_.empty()) {
      timeout = &ts;  // poll only
    } else {
      LoopClock::time_point wake_at = LoopClock::time_point::max();
      if (!timer_queue_.empty()) wake_at = timer_queue_.begin()->first;
      if (stopping_) wake_at = std::min(wake_at, stop_deadline);
      if (wake_at != LoopClock::time_point::max()) {
        auto delta = std::chrono::duration_cast<std::chrono::nanoseconds>(wake_at - LoopClock::now());
        if (delta.count() < 0) delta = std::chrono::nanoseconds(0);
        ts.tv_sec = delta.count() / 1000000000;
        ts.tv_nsec = delta.count() % 1000000000;
        timeout = &ts;
      }
    }
    if (epoll_mode()) {
      int ms = -1;
      if (timeout != nullptr) {
        // Rounded up: a timer is never woken for early.
        const int64_t wait_ms = int64_t{timeout->tv_sec} * 1000 + (timeout->tv_nsec + 999999) / 1000000;
        ms = static_cast<int>(std::min<int64_t>(wait_ms, 3600 * 1000));
      }
      EpollWait(ms);
      continue;
    }
    io_uring_cqe* cqe = nullptr;
    busy_since_ns_.store(0, std::memory_order_relaxed);
    int r = io_uring_submit_and_wait_timeout(&ring_, &cqe, 1, timeout, nullptr);
    busy_since_ns_.store(LoopClock::now().time_since_epoch().count(), std::memory_order_relaxed);
    if (r < 0 && r != -ETIME && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
      LOG(ERROR) << "io_uring wait failed: " << std::strerror(-r);
    }
    ReapCompletions();
  }
  FinishStopping();
}

void Loop::FinishStopping() {
  if (ring_ready_) io_uring_submit(&ring_);  // flush any cancel requests still queued
  std::vector<absl::AnyInvocable<void()>> batch;
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    post_closed_ = true;
    batch.swap(posted_);
  }
  for (auto& fn : batch) fn();
  timer_queue_.clear();
  timers_.clear();
  finished_.store(true, std::memory_order_release);
}

}  // namespace fusekeeper
