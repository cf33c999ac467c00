#include "agent/fkserve/relay/relay.h"

#include <linux/fuse.h>

#include "agent/fkserve/relay/kernel_notifier.h"
#include "agent/fkserve/relay/program_socket.h"
#include "agent/fkserve/relay/pulse.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <deque>
#include <future>
#include <optional>
#include <unordered_set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/fkserve/relay/fuse_wire.h"
#include "agent/loop/loop.h"

namespace fusekeeper::relay {

namespace {

// Runs fn on the relay's loop thread and waits for what it returns; nullopt (fn not run) once
// the loop has stopped. Every Relay method but Start and Stop comes through here. `now`: the
// caller is the loop's thread (a relay on its owner's loop): fn runs at once.
template <typename F>
auto RunOn(Loop& loop, bool now, F fn) -> std::optional<decltype(fn())> {
  if (now) {
    if (loop.stop_requested()) return std::nullopt;
    return fn();
  }
  std::promise<decltype(fn())> result;
  if (!loop.Post([&] { result.set_value(fn()); })) return std::nullopt;
  return result.get_future().get();
}

}  // namespace

// One program instance's socket, with the ring operations on it. Retired (closed, its
// operations cancelled) when the next instance comes or the program closes its end; freed when
// its last operation has completed.
struct ProgramConn {
  UniqueFd fd;
  Completion poll, out;
  bool poll_armed = false, out_armed = false, retired = false;
  std::deque<std::string> pending;  // messages the socket would not take yet
};

struct Relay::LoopState final : RelayOutput {
  std::unique_ptr<Loop> own_loop;  // a relay on a thread of its own
  Loop* loop = nullptr;            // own_loop, or its owner's

  // RunOn this relay's loop: at once on its owner's (the caller is that loop's thread), else
  // posted to its own thread.
  template <typename F>
  auto Call(F fn) {
    return RunOn(*loop, own_loop == nullptr, std::move(fn));
  }
  UniqueFd kernel;
  RelayCallbacks cb;
  size_t max_message = 0;
  std::unique_ptr<StateJournal> journal;  // declared before the core, which writes to it
  std::unique_ptr<RelayCore> core;
  std::unique_ptr<KernelNotifier> notifier;
  // The kernel's connection is non-blocking (O_NONBLOCK, set at Start) and drained with read(2)
  // whenever a multishot POLL says it is readable. Not io_uring READs: io_uring (6.10+) tries a
  // READ of a pollable file without FMODE_NOWAIT inline, in this thread, when poll says it is
  // readable, and /dev/fuse's read ignores IOCB_NOWAIT; when the request is gone by then (taken
  // by another read, or withdrawn by a killed caller) that read sleeps here, and no answer of
  // the program's reaches the kernel any more (seen: relay_bench stopped with this thread in
  // fuse_dev_do_read).
  Completion kpoll;
  bool kpoll_armed = false;
  std::vector<char> kbuf;
  std::vector<char> pbuf;
  int kernel_errors = 0;
  ProgramConn* conn = nullptr;
  LoopClock::time_point started;
  bool awaiting_first_answer = false;
  bool ended = false;
  // Whether the current instance answers (ProgramLimits): its last message, since when requests
  // have been in flight, the lock waits among them (a lock wait may last), and whether it was
  // reported already.
  ProgramLimits limits;
  LoopClock::time_point last_from_program;
  LoopClock::time_point busy_since;
  bool busy = false;
  bool unresponsive = false;
  std::unordered_set<uint64_t> lock_waits;
  // Handed over to the instance's own core (Relay::HandOver): the kernel is not read, the
  // instance not watched; its socket is held here, unread.
  bool handed_over = false;
  UniqueFd held;
  UniqueFd pulse_fd;
  Pulse* pulse = nullptr;  // mapped from pulse_fd
  LoopClock::time_point pending_since;  // handed over: since when the kernel has had requests unread
  int64_t pending_activity = 0;         // the pulse's last activity then
  Durability durability = Durability::kAtSync;

  ~LoopState() override {
    if (pulse != nullptr) munmap(pulse, 4096);
  }

  void Log(const std::string& line) override {
    if (cb.log) cb.log(line);
  }

  void ToKernel(const char* data, size_t len) override {
    if (len >= sizeof(fuse_out_header) && reinterpret_cast<const fuse_out_header*>(data)->unique == 0) {
      notifier->Push(data, len);  // never from this thread: kernel_notifier.h
      return;
    }
    ssize_t n;
    do {
      n = write(kernel.get(), data, len);
    } while (n < 0 && errno == EINTR);
    // ENOENT: the request was interrupted and is answered already; ENODEV: the connection ended.
    if (n < 0 && errno != ENOENT && errno != ENODEV) {
      Log(absl::StrCat("relay: writing ", len, " bytes to the kernel: ", strerror(errno)));
    }
  }

  void ToProgram(const iovec* iov, int iovcnt) override {
    if (conn == nullptr || conn->retired) return;  // the instance is going: resent to the next
    if (conn->pending.empty()) {
      msghdr m{};
      m.msg_iov = const_cast<iovec*>(iov);
      m.msg_iovlen = static_cast<size_t>(iovcnt);
      ssize_t n;
      do {
        n = sendmsg(conn->fd.get(), &m, MSG_DONTWAIT | MSG_NOSIGNAL);
      } while (n < 0 && errno == EINTR);
      if (n >= 0) return;
      if (errno == EPIPE || errno == ECONNRESET) return;
      if (errno != EAGAIN) {
        Log(absl::StrCat("relay: sending to the program: ", strerror(errno)));
        return;
      }
    }
    std::string copy;
    for (int i = 0; i < iovcnt; ++i) copy.append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
    conn->pending.push_back(std::move(copy));
    ArmProgramOut(conn);
  }

  void ArmKernelPoll() {
    kpoll.callback = [this](int32_t res, bool more) {
      if (!more) kpoll_armed = false;
      // Cancelled by a HandOver that a TakeBack has undone since: read again.
      const bool rearm = !more && !ended && !handed_over && !loop->stop_requested();
      if (res == -ECANCELED || ended || handed_over) {
        if (rearm) ArmKernelPoll();
        return;
      }
      DrainKernel();
      if (rearm) ArmKernelPoll();
    };
    kpoll_armed = true;
    loop->PollAdd(&kpoll, kernel.get(), POLLIN, /*multishot=*/true);
  }

  // Every request the kernel has for us now (until EAGAIN: the poll fires again only on news).
  void DrainKernel() {
    while (!ended && !handed_over) {
      const ssize_t n = read(kernel.get(), kbuf.data(), kbuf.size());
      if (n > 0) {
        kernel_errors = 0;
        if (static_cast<size_t>(n) >= kInHeader) {
          const fuse_in_header h = InHeader(kbuf.data());
          if (h.opcode == FUSE_SETLKW) lock_waits.insert(h.unique);
        }
        core->FromKernel(kbuf.data(), static_cast<size_t>(n));
        AfterEvent();
        continue;
      }
      const int err = n == 0 ? EIO : errno;
      if (err == EAGAIN) return;
      if (err == EINTR || err == ENOENT) continue;  // ENOENT: the request was withdrawn
      if (err == ENODEV || err == ECONNABORTED) {  // unmounted, or aborted
        ended = true;
        Log("relay: the kernel's connection ended (unmounted or aborted)");
        if (conn != nullptr) Retire(conn);
        if (cb.connection_ended) cb.connection_ended();
        return;
      }
      Log(absl::StrCat("relay: reading the kernel's connection: ", strerror(err)));
      if (++kernel_errors > 100) {
        ended = true;
        if (cb.connection_ended) cb.connection_ended();
      }
      return;
    }
  }

  void ArmProgramPoll(ProgramConn* c) {
    c->poll.callback = [this, c](int32_t res, bool more) {
      if (!more) c->poll_armed = false;
      if (!c->retired && res > 0) DrainProgram(c);
      if (c->retired) {
        MaybeFree(c);
        return;
      }
      if (!more && res != -ECANCELED) ArmProgramPoll(c);
    };
    c->poll_armed = true;
    loop->PollAdd(&c->poll, c->fd.get(), POLLIN, /*multishot=*/true);
  }

  void ArmProgramOut(ProgramConn* c) {
    if (c->out_armed) return;
    c->out.callback = [this, c](int32_t res, bool) {
      c->out_armed = false;
      if (c->retired) {
        MaybeFree(c);
        return;
      }
      if (res >= 0) FlushPending(c);
    };
    c->out_armed = true;
    loop->PollAdd(&c->out, c->fd.get(), POLLOUT, /*multishot=*/false);
  }

  void FlushPending(ProgramConn* c) {
    while (!c->pending.empty()) {
      const std::string& m = c->pending.front();
      const ssize_t n = send(c->fd.get(), m.data(), m.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) {
        ArmProgramOut(c);
        return;
      }
      if (n < 0) Log(absl::StrCat("relay: sending to the program: ", strerror(errno)));
      c->pending.pop_front();
    }
  }

  void DrainProgram(ProgramConn* c) {
    while (!c->retired) {
      const ssize_t n = recv(c->fd.get(), pbuf.data(), pbuf.size(), MSG_DONTWAIT | MSG_TRUNC);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) return;
      if (n <= 0) {
        // Every process that held the program's end has closed it: that instance is gone.
        if (c == conn) {
          core->ProgramGone();
          conn = nullptr;
        }
        Retire(c);
        return;
      }
      if (c == conn) last_from_program = LoopClock::now();
      if (static_cast<size_t>(n) >= kOutHeader) {
        lock_waits.erase(OutHeader(pbuf.data()).unique);
      }
      const bool truncated = static_cast<size_t>(n) > pbuf.size();
      core->FromProgram(pbuf.data(), truncated ? pbuf.size() : static_cast<size_t>(n), truncated);
      AfterEvent();
    }
  }

  void AfterEvent() {
    const bool now_busy = core->requests_in_flight() > 0;
    if (now_busy && !busy) busy_since = LoopClock::now();
    busy = now_busy;
    if (!now_busy) lock_waits.clear();
    if (awaiting_first_answer && core->stats().answers_since_start > 0) {
      awaiting_first_answer = false;
      if (cb.first_answer) cb.first_answer(LoopClock::now() - started, core->stats());
    }
  }

  void Retire(ProgramConn* c) {
    if (c->retired) return;
    c->retired = true;
    if (c == conn) conn = nullptr;
    if (c->poll_armed) loop->Cancel(&c->poll);
    if (c->out_armed) loop->Cancel(&c->out);
    c->pending.clear();
    MaybeFree(c);
  }

  void MaybeFree(ProgramConn* c) {
    if (c->retired && !c->poll_armed && !c->out_armed) delete c;
  }

  bool HandOver(UniqueFd* pulse_out) {
    if (ended || handed_over || conn == nullptr || conn->retired) return false;
    if (core->stats().program_messages_since_start > 0) return false;
    if (pulse == nullptr) {
      pulse_fd = UniqueFd(memfd_create("fkserve-pulse", MFD_CLOEXEC));
      void* m = pulse_fd && ftruncate(pulse_fd.get(), 4096) == 0
                    ? mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, pulse_fd.get(), 0)
                    : MAP_FAILED;
      if (m == MAP_FAILED) return false;
      pulse = new (m) Pulse();
    }
    pulse->busy = 0;
    pulse->init_done = core->initialized() ? 1 : 0;
    pulse->last_activity_ns = MonotonicNs();
    pending_activity = -1;
    *pulse_out = UniqueFd(fcntl(pulse_fd.get(), F_DUPFD_CLOEXEC, 3));
    handed_over = true;
    if (kpoll_armed) loop->Cancel(&kpoll);
    // Kept open: a second thread of the program may still be reading it.
    held = UniqueFd(fcntl(conn->fd.get(), F_DUPFD_CLOEXEC, 3));
    Retire(conn);
    return true;
  }

  absl::Status TakeBack() {
    if (!handed_over) return absl::OkStatus();
    SavedState saved;
    auto j = StateJournal::Open(UniqueFd(fcntl(journal->fd(), F_DUPFD_CLOEXEC, 3)), &saved);
    if (!j.ok()) return j.status();
    auto fresh = std::make_unique<RelayCore>(this, max_message, durability);
    fresh->SetJournal(j->get());
    if (!saved.init_request.empty()) fresh->Restore(saved);
    core = std::move(fresh);
    journal = std::move(*j);
    handed_over = false;
    held.Reset();
    if (absl::Status s = ResendAndTakeIn(); !s.ok()) return s;
    if (!kpoll_armed) ArmKernelPoll();
    return absl::OkStatus();
  }

  // What the kernel's connection had read and not answered (by a dead launcher, or a dead
  // instance with the core in it) is sent again, and taken into the core now, before the next
  // instance is attached: a request the dead one may have done (a RENAME) is decided before any
  // of the next one's resolves a path through it (in_program.cc says what it cost). ENODEV: the
  // connection has ended (UNAVAILABLE).
  absl::Status ResendAndTakeIn() {
    if (const int err = AskKernelToResend(kernel.get()); err != 0) {
      if (err == ENODEV || err == ECONNABORTED) {  // unmounted, or aborted
        ended = true;
        return absl::UnavailableError("the kernel's connection has ended");
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "the kernel cannot resend the requests read and not answered (FUSE_NOTIFY_RESEND, Linux 6.9+): ",
          strerror(err)));
    }
    DrainKernel();
    return absl::OkStatus();
  }

  void Attach(UniqueFd ours) {
    held.Reset();
    if (conn != nullptr) Retire(conn);
    auto* c = new ProgramConn();
    c->fd = std::move(ours);
    conn = c;
    started = LoopClock::now();
    last_from_program = started;
    unresponsive = false;
    awaiting_first_answer = true;
    core->ProgramStarted();
    ArmProgramPoll(c);
    AfterEvent();
  }

  // Looks at the current instance every `tick` while the connection lasts.
  void Watch(std::chrono::milliseconds tick) {
    if (ended) return;
    CheckProgram();
    loop->AddTimer(tick, [this, tick] { Watch(tick); });
  }

  std::string InitTimeoutWhy() const {
    return absl::StrCat("did not answer the kernel's FUSE_INIT within ", limits.init_timeout.count(),
                        " ms of its start");
  }
  // `in_flight`: how many, where the relay knows (0: it does not).
  std::string StallWhy(size_t in_flight, int64_t quiet_ms) const {
    return absl::StrCat("stopped answering: ", in_flight > 0 ? absl::StrCat(in_flight, " ") : "",
                        "request(s) in flight to it and no message from it for ", quiet_ms,
                        " ms (--program_stall_ms=", limits.stall.count(), ")");
  }

  // Handed over: the instance's pulse, and the kernel's queue (requests no thread of it reads).
  void CheckHandedOver() {
    using std::chrono::milliseconds;
    const LoopClock::time_point now = LoopClock::now();
    const int64_t now_ns = MonotonicNs();
    std::string why;
    if (!pulse->init_done) {
      if (limits.init_timeout.count() > 0 && now - started >= limits.init_timeout) why = InitTimeoutWhy();
    } else if (limits.stall.count() > 0) {
      const int64_t activity = pulse->last_activity_ns.load();
      pollfd p{kernel.get(), POLLIN, 0};
      const bool pending = poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
      if (!pending || activity != pending_activity) {
        pending_activity = pending ? activity : -1;
        pending_since = now;
      }
      int64_t quiet_ns = 0;
      if (pulse->busy) quiet_ns = now_ns - std::max(activity, pulse->busy_since_ns.load());
      if (pending) {
        quiet_ns = std::max<int64_t>(
            quiet_ns, std::chrono::duration_cast<std::chrono::nanoseconds>(now - pending_since).count());
      }
      if (cb.last_work) {
        quiet_ns = std::min<int64_t>(
            quiet_ns, std::chrono::duration_cast<std::chrono::nanoseconds>(now - cb.last_work()).count());
      }
      if (quiet_ns >= std::chrono::duration_cast<std::chrono::nanoseconds>(limits.stall).count()) {
        // (In flight: read by it and not answered, or waiting in the kernel for it to read.)
        why = StallWhy(0, quiet_ns / 1000000);
      }
    }
    if (why.empty()) return;
    unresponsive = true;
    Log(absl::StrCat("relay: the program ", why));
    if (cb.program_unresponsive) cb.program_unresponsive(why, pulse->init_done != 0);
  }

  void CheckProgram() {
    if (handed_over && pulse != nullptr && !unresponsive && !ended) return CheckHandedOver();
    if (handed_over || conn == nullptr || conn->retired || unresponsive) return;
    using std::chrono::duration_cast;
    using std::chrono::milliseconds;
    const LoopClock::time_point now = LoopClock::now();
    std::string why;
    if (!core->initialized()) {
      if (limits.init_timeout.count() > 0 && now - started >= limits.init_timeout) why = InitTimeoutWhy();
    } else if (limits.stall.count() > 0 && busy && core->requests_in_flight() > lock_waits.size()) {
      LoopClock::time_point quiet_since = std::max(last_from_program, busy_since);
      if (cb.last_work) quiet_since = std::max(quiet_since, cb.last_work());
      if (now - quiet_since >= limits.stall) {
        why = StallWhy(core->requests_in_flight(), duration_cast<milliseconds>(now - quiet_since).count());
      }
    }
    if (why.empty()) return;
    unresponsive = true;
    Log(absl::StrCat("relay: the program ", why));
    if (cb.program_unresponsive) cb.program_unresponsive(why, core->initialized());
  }
};

absl::StatusOr<std::unique_ptr<Relay>> Relay::Start(int kernel_fd, RelayCallbacks callbacks, UniqueFd state,
                                                   Durability durability, Loop* on) {
  std::unique_ptr<Relay> r(new Relay());
  auto largest = LargestProgramMessage();
  if (!largest.ok()) return largest.status();
  r->max_message_ = *largest;

  // On a loop of its own: the ring, or epoll where seccomp refuses io_uring (the relay only polls,
  // and reads and writes by itself).
  auto st = std::make_unique<LoopState>();
  if (on == nullptr) {
    auto loop = Loop::Create({.epoll_without_ring = true});
    if (!loop.ok()) return loop.status();
    st->own_loop = std::move(*loop);
    on = st->own_loop.get();
  }
  st->loop = on;
  if (const std::string& why = on->without_ring_why(); !why.empty() && callbacks.log) {
    callbacks.log(absl::StrCat("relay: waiting with epoll (", why, ")"));
  }
  st->kernel = UniqueFd(fcntl(kernel_fd, F_DUPFD_CLOEXEC, 3));
  if (!st->kernel.valid()) return absl::InternalError(absl::StrCat("dup of the connection: ", strerror(errno)));
  st->cb = std::move(callbacks);
  st->notifier = std::make_unique<KernelNotifier>(st->kernel.get(), st->cb.log);
  st->max_message = r->max_message_;
  st->durability = r->durability_ = durability;
  st->core = std::make_unique<RelayCore>(st.get(), r->max_message_, durability);
  const bool adopting = state.valid();
  if (adopting) {
    SavedState saved;
    auto j = StateJournal::Open(std::move(state), &saved);
    if (!j.ok()) return j.status();
    if (saved.init_request.empty()) {
      return absl::FailedPreconditionError("the relay state holds no answered FUSE_INIT: nothing to carry on from");
    }
    st->journal = std::move(*j);
    r->restored_nodes_ = saved.nodes.size();
    r->restored_handles_ = saved.handles.size();
    st->core->SetJournal(st->journal.get());
    st->core->Restore(saved);
  } else {
    auto j = StateJournal::Create();
    if (!j.ok()) return j.status();
    st->journal = std::move(*j);
    st->core->SetJournal(st->journal.get());
  }
  r->state_fd_ = st->journal->fd();
  // The kernel checks that a read can take its largest WRITE: header, fuse_write_in, max_write.
  st->pbuf.resize(r->max_message_);
  st->kbuf.resize(r->max_message_);
  // Our reads never sleep (see kpoll). The flag is the open file's, which the agent's dup and
  // whoever is handed the connection next share: the agent clears it before it hands it on.
  const int fl = fcntl(st->kernel.get(), F_GETFL);
  if (fl < 0 || fcntl(st->kernel.get(), F_SETFL, fl | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("making the connection non-blocking: ", strerror(errno)));
  }
  if (adopting) {
    // The requests the dead launcher had read wait in the kernel's processing queue: sent again
    // (unique | FUSE_UNIQUE_RESEND), and taken in before the first instance is attached (as after
    // a take-back). Without it they would hang.
    if (absl::Status s = st->ResendAndTakeIn(); !s.ok()) return s;
  }
  st->ArmKernelPoll();
  r->state_ = std::move(st);
  if (r->state_->own_loop == nullptr) return r;  // its owner runs the loop
  r->thread_ = std::thread([raw = r->state_.get()] {
    // Stop signals are the launcher's (its main thread forwards them to the program).
    sigset_t block;
    sigemptyset(&block);
    for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGCHLD}) sigaddset(&block, sig);
    pthread_sigmask(SIG_BLOCK, &block, nullptr);
    raw->loop->Run();
  });
  return r;
}

Relay::~Relay() { Stop(); }

void Relay::Stop() {
  if (state_ == nullptr || stopped_) return;
  if (thread_.joinable()) {
    state_->loop->Stop();
    thread_.join();
  }
  // On its owner's loop, Stop comes after that loop's Run has returned (relay.h): the callbacks
  // of what was in flight have run by then.
  stopped_ = true;
  if (state_->conn != nullptr) {
    state_->conn->retired = true;
    state_->conn->poll_armed = state_->conn->out_armed = false;
    delete state_->conn;
    state_->conn = nullptr;
  }
}

absl::StatusOr<UniqueFd> Relay::NewInstanceSocket() {
  auto pair = NewProgramSocketPair();
  if (!pair.ok()) return pair.status();
  LoopState* st = state_.get();
  const bool attached = st->Call([&] {
                          st->Attach(std::move(pair->ours));
                          return true;
                        }).has_value();
  if (!attached) return absl::UnavailableError("the relay has stopped");
  return std::move(pair->theirs);
}

void Relay::WatchPrograms(ProgramLimits limits) {
  const std::chrono::milliseconds shortest =
      limits.init_timeout.count() > 0 && limits.stall.count() > 0 ? std::min(limits.init_timeout, limits.stall)
                                                                  : std::max(limits.init_timeout, limits.stall);
  if (shortest.count() <= 0) return;
  // Late by at most an eighth of the bound (and at most a second); a look costs a few loads.
  const std::chrono::milliseconds tick =
      std::clamp(shortest / 8, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
  LoopState* st = state_.get();
  st->Call([&] {
    st->limits = limits;
    st->Watch(tick);
    return true;
  });
}

bool Relay::HandOver(UniqueFd* pulse) {
  LoopState* st = state_.get();
  return st->Call([&] { return st->HandOver(pulse); }).value_or(false);
}

absl::Status Relay::TakeBack() {
  LoopState* st = state_.get();
  // The journal is opened again by the take-back: its fd comes back with the outcome.
  auto taken = st->Call([&] {
    absl::Status s = st->TakeBack();
    return std::make_pair(s, st->journal->fd());
  });
  if (!taken.has_value()) return absl::UnavailableError("the relay has stopped");
  if (taken->first.ok()) state_fd_ = taken->second;
  return taken->first;
}

RelayStats Relay::Snapshot() {
  LoopState* st = state_.get();
  return st->Call([&] { return st->core->stats(); }).value_or(RelayStats{});
}

}  // namespace fusekeeper::relay
