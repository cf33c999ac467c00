#include "agent/fuse/handoff_io.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cstring>

#include "agent/base/status.h"
#include "glog/logging.h"

namespace fusekeeper {

// ---- HandoffListener ----

HandoffListener::HandoffListener(Loop& loop, PendingWork& work, UniqueFd fd, std::string tag, std::string what,
                                 OnAccept on_accept)
    : loop_(loop),
      work_(work),
      fd_(std::move(fd)),
      tag_(std::move(tag)),
      what_(std::move(what)),
      on_accept_(std::move(on_accept)) {
  accept_.callback = [this](int32_t res, bool) { OnCompleted(res); };
}

HandoffListener::~HandoffListener() { CHECK(!in_flight_) << "a handoff listener freed with its accept in flight"; }

void HandoffListener::Start() {
  if (!closed_ && !in_flight_) Arm();
}

void HandoffListener::Arm() {
  in_flight_ = true;
  work_.Began();
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_accept(sqe, fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
  loop_.Arm(sqe, &accept_);
}

void HandoffListener::Close() {
  if (closed_) return;
  closed_ = true;
  if (in_flight_) loop_.Cancel(&accept_);
  fd_.Reset();
}

void HandoffListener::OnCompleted(int32_t res) {
  PendingWork::EndedGuard ended(work_);
  in_flight_ = false;
  const bool was_pause = backoff_.paused();  // then res is the pause's (-ETIME or -ECANCELED)
  backoff_.Ended();
  const std::string what = "handoff listener for " + what_ + (tag_.empty() ? "" : " on " + tag_);
  bool pause = false;
  if (was_pause) {
  } else if (res >= 0) {
    backoff_.Resumed(what);
    UniqueFd connection(res);
    if (!closed_) on_accept_(std::move(connection));  // (closed: it closes here)
  } else if (AcceptBackoff::OutOfResources(res)) {
    pause = true;
  } else if (res != -ECANCELED && res != -EINTR) {
    LOG(WARNING) << "handoff accept for " << what_ << (tag_.empty() ? "" : " on " + tag_) << ": " << strerror(-res);
  }
  if (!closed_ && res != -ECANCELED && loop_.running()) {
    if (!pause) return Arm();
    in_flight_ = true;
    work_.Began();
    backoff_.Pause(loop_, &accept_, what, res);
  } else if (closed_ && on_ended_) {
    auto ended_now = std::move(on_ended_);
    on_ended_ = nullptr;
    ended_now();
  }
}

// ---- HandoffPeer ----

HandoffPeer::HandoffPeer(Loop& loop, PendingWork& work, UniqueFd fd, size_t max_message_bytes)
    : loop_(loop), work_(work), fd_(std::move(fd)), max_message_bytes_(max_message_bytes), deadline_(loop) {
  send_.callback = [this](int32_t res, bool) {
    PendingWork::EndedGuard ended(work_);
    send_in_flight_ = false;
    auto done = std::move(send_done_);
    send_done_ = nullptr;
    done(res);
  };
  recv_.callback = [this](int32_t res, bool) {
    PendingWork::EndedGuard ended(work_);
    OnReceived(res);
  };
}

HandoffPeer::~HandoffPeer() {
  CHECK(!send_in_flight_ && !recv_in_flight_) << "a handoff connection freed with an operation in flight";
}

absl::StatusOr<ucred> HandoffPeer::Credentials() const {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoStatus(errno, "SO_PEERCRED on handoff connection");
  }
  return cred;
}

void HandoffPeer::Send(std::string bytes, std::vector<int> fds, SendDone done) {
  CHECK(!send_in_flight_) << "one handoff send at a time";
  out_ = std::move(bytes);
  out_iov_ = {out_.data(), out_.size()};
  out_msg_ = {};
  out_msg_.msg_iov = &out_iov_;
  out_msg_.msg_iovlen = 1;
  if (!fds.empty()) AttachFds(&out_msg_, &out_control_, fds.data(), fds.size());
  send_done_ = std::move(done);
  send_in_flight_ = true;
  work_.Began();
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_sendmsg(sqe, fd_.get(), &out_msg_, MSG_NOSIGNAL);
  loop_.Arm(sqe, &send_);
}

void HandoffPeer::Receive(std::optional<absl::Duration> deadline, ReceiveDone done) {
  CHECK(!recv_in_flight_) << "one handoff receive at a time";
  in_.assign(max_message_bytes_ + 1, '\0');  // one more: a longer message shows as truncated
  in_iov_ = {in_.data(), in_.size()};
  in_msg_ = {};
  in_msg_.msg_iov = &in_iov_;
  in_msg_.msg_iovlen = 1;
  in_msg_.msg_control = in_control_.bytes;
  in_msg_.msg_controllen = sizeof(in_control_.bytes);
  receive_done_ = std::move(done);
  recv_in_flight_ = true;
  work_.Began();
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_recvmsg(sqe, fd_.get(), &in_msg_, MSG_CMSG_CLOEXEC);
  loop_.Arm(sqe, &recv_);
  // Only fires while the receive is in flight, so this peer is alive.
  if (deadline) deadline_.Arm(absl::ToChronoNanoseconds(*deadline), [this] { loop_.Cancel(&recv_); });
}

void HandoffPeer::OnReceived(int32_t res) {
  recv_in_flight_ = false;
  deadline_.Cancel();
  Received got;
  got.res = res;
  if (res > 0) {
    got.fds = TakeReceivedFds(in_msg_, &got.other_control);
    got.message = absl::string_view(in_.data(), static_cast<size_t>(res));
    got.truncated = (in_msg_.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0 || static_cast<size_t>(res) > max_message_bytes_;
  }
  auto done = std::move(receive_done_);
  receive_done_ = nullptr;
  done(std::move(got));  // last: it may receive again (into in_, which `message` points at)
}

void HandoffPeer::Cancel() {
  if (send_in_flight_) loop_.Cancel(&send_);
  if (recv_in_flight_) loop_.Cancel(&recv_);
}

void HandoffPeer::Close() {
  CHECK(!send_in_flight_ && !recv_in_flight_) << "a handoff connection closed with an operation in flight";
  fd_.Reset();
}

bool HandoffPeer::SendNow(absl::string_view bytes) {
  return send(fd_.get(), bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

bool HandoffPeer::HungUp() const {
  pollfd p{fd_.get(), POLLRDHUP, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0;
}

bool HandoffPeer::WaitsQuietly() const {
  pollfd p{fd_.get(), POLLIN | POLLRDHUP, 0};
  return poll(&p, 1, 0) >= 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLIN)) == 0;
}

std::vector<std::string> HandoffPeer::QueuedAfterReset() {
  // The peer is gone, and the socket is made non-blocking anyway: never waits.
  fcntl(fd_.get(), F_SETFL, fcntl(fd_.get(), F_GETFL) | O_NONBLOCK);
  std::vector<std::string> queued;
  std::vector<char> buf(max_message_bytes_);
  for (int i = 0; i < 4096; ++i) {
    std::vector<UniqueFd> fds;
    int flags = 0;
    bool other_control = false;
    const ssize_t n = ReceiveWithFds(fd_.get(), buf.data(), buf.size(), &fds, &flags, &other_control);
    if (n <= 0) break;
    queued.emplace_back(buf.data(), static_cast<size_t>(n));
  }
  return queued;
}

// ---- AbortWatch ----

AbortWatch::AbortWatch(Loop& loop, PendingWork& work, absl::AnyInvocable<void()> on_aborted)
    : loop_(loop), work_(work), on_aborted_(std::move(on_aborted)) {}

AbortWatch::~AbortWatch() {
  for (const auto& slot : slots_) CHECK(!slot->in_flight) << "an abort watch freed with its poll in flight";
}

void AbortWatch::Watch(int fd) {
  Stop();
  Slot* slot = nullptr;
  for (auto& s : slots_) {
    if (!s->in_flight) slot = s.get();
  }
  if (slot == nullptr) {
    slots_.push_back(std::make_unique<Slot>());
    slot = slots_.back().get();
    // Set once, when the slot is made: it may re-arm its own slot, and must not be replaced while
    // it runs.
    slot->completion.callback = [this, slot](int32_t res, bool) {
      PendingWork::EndedGuard ended(work_);
      slot->in_flight = false;
      if (slot != current_) return;  // a watch that was stopped or replaced
      if (res > 0 && (res & (POLLERR | POLLHUP))) {
        current_ = nullptr;
        on_aborted_();
      } else if (res >= 0) {
        Arm(slot, fd_);  // woken without an error: keep watching
      } else {
        current_ = nullptr;  // cancelled by the loop's stop, or failed: nothing is watched
      }
    };
  }
  current_ = slot;
  fd_ = fd;
  Arm(slot, fd);
}

void AbortWatch::Arm(Slot* slot, int fd) {
  slot->in_flight = true;
  work_.Began();
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_poll_add(sqe, fd, POLLERR);
  loop_.Arm(sqe, &slot->completion);
}

void AbortWatch::Stop() {
  if (current_ == nullptr) return;
  if (current_->in_flight) loop_.Cancel(&current_->completion);  // completes later, quietly
  current_ = nullptr;
}

}  // namespace fusekeeper
