// The handoff's ring adapter: the sockets of one volume's endpoint and their operations on the
// loop's ring. Bytes, fds, deadlines and hang-ups only: no protocol and no decisions (the endpoint
// decodes, HandoffPolicy decides).
//
//   HandoffListener  a listening socket whose accepts run one after another.
//   HandoffPeer      one server's connection: its credentials, a send with fds, a receive with
//                    the fds that came (under an optional deadline), and calls that never wait.
//   AbortWatch       POLLERR on the endpoint's kept /dev/fuse fd: the connection was aborted.
//
// Every operation counts in its owner's PendingWork (lifetime.h) from its arming until its
// callback has returned, so the owner outlives it. An object of this file must not be destroyed
// while one of its operations is in flight (it CHECKs): cancel, wait for the callback, then
// destroy it (DeleteLater from inside the callback).
//
// Threading: the loop thread only. Callbacks run on it, never from inside the call that armed
// them.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "agent/base/fd_passing.h"
#include "agent/base/unique_fd.h"
#include "agent/loop/lifetime.h"
#include "agent/loop/accept_backoff.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

class HandoffListener {
 public:
  // An accepted connection (O_CLOEXEC); only while the listener is open.
  using OnAccept = absl::AnyInvocable<void(UniqueFd connection)>;
  // `what` names it in logs ("volume v1").
  HandoffListener(Loop& loop, PendingWork& work, UniqueFd fd, std::string tag, std::string what, OnAccept on_accept);
  ~HandoffListener();
  HandoffListener(const HandoffListener&) = delete;
  HandoffListener& operator=(const HandoffListener&) = delete;

  // Runs (once) when the closed listener's last accept has come back: it may be freed then.
  void set_on_ended(absl::AnyInvocable<void()> on_ended) { on_ended_ = std::move(on_ended); }
  // Accepts until Close (or until the loop stops running); a failed accept is logged and retried.
  void Start();
  // Closes the socket and cancels the accept in flight.
  void Close();
  bool closed() const { return closed_; }
  // Closed and no accept in flight.
  bool ended() const { return closed_ && !in_flight_; }
  const std::string& tag() const { return tag_; }
  // Out of fds: the accept's back-off (accept_backoff.h) so far.
  const AcceptBackoff& backoff() const { return backoff_; }

 private:
  void Arm();
  void OnCompleted(int32_t res);

  Loop& loop_;
  PendingWork& work_;
  UniqueFd fd_;
  const std::string tag_;
  const std::string what_;
  OnAccept on_accept_;
  absl::AnyInvocable<void()> on_ended_;
  Completion accept_;       // the accept, or the pause before the next one (backoff_)
  AcceptBackoff backoff_;   // out of fds: the next accept waits
  bool in_flight_ = false;
  bool closed_ = false;
};

class HandoffPeer {
 public:
  // res: bytes sent, or -errno.
  using SendDone = absl::AnyInvocable<void(int32_t res)>;
  // What a receive got: res is the message's length, 0 at the peer's close, or -errno
  // (-ECANCELED: the deadline passed, or Cancel). `message` and `fds` are the message's;
  // `other_control`: something else came with it (closed); `truncated`: it did not fit.
  struct Received {
    int32_t res = 0;
    absl::string_view message;
    std::vector<UniqueFd> fds;
    bool other_control = false;
    bool truncated = false;
  };
  using ReceiveDone = absl::AnyInvocable<void(Received received)>;

  HandoffPeer(Loop& loop, PendingWork& work, UniqueFd fd, size_t max_message_bytes);
  ~HandoffPeer();
  HandoffPeer(const HandoffPeer&) = delete;
  HandoffPeer& operator=(const HandoffPeer&) = delete;

  // The peer's pid and uid (SO_PEERCRED; the pid is 0 in another pid namespace).
  absl::StatusOr<ucred> Credentials() const;
  // One message with fds (-1s are skipped); `done` when the kernel took it. One send at a time.
  void Send(std::string bytes, std::vector<int> fds, SendDone done);
  // The next message, and the fds that came with it; with a deadline, cancelled once it passes.
  // One receive at a time; `done` may start the next one.
  void Receive(std::optional<absl::Duration> deadline, ReceiveDone done);
  // Cancels the send and receive in flight: their callbacks come with -ECANCELED.
  void Cancel();
  // Closes the socket (nothing may be in flight on it).
  void Close();
  bool open() const { return fd_.valid(); }
  int fd() const { return fd_.get(); }

  // These never wait.
  // A few bytes on a socket with room (MSG_DONTWAIT): false with errno set if not sent whole.
  bool SendNow(absl::string_view bytes);
  // The peer has closed its end.
  bool HungUp() const;
  // The peer is there and has sent nothing since (what a server waiting on standby does).
  bool WaitsQuietly() const;
  // The messages still queued on a socket the peer reset (in order; their fds are closed): a
  // reset is reported before what the peer sent last.
  std::vector<std::string> QueuedAfterReset();

 private:
  void OnReceived(int32_t res);

  Loop& loop_;
  PendingWork& work_;
  UniqueFd fd_;
  const size_t max_message_bytes_;
  std::string out_;
  iovec out_iov_{};
  msghdr out_msg_{};
  FdControl out_control_;
  std::string in_;
  iovec in_iov_{};
  msghdr in_msg_{};
  FdControl in_control_;
  Completion send_;
  Completion recv_;
  SendDone send_done_;
  ReceiveDone receive_done_;
  Timer deadline_;
  bool send_in_flight_ = false;
  bool recv_in_flight_ = false;
};

class AbortWatch {
 public:
  // `on_aborted` (loop thread) when the watched fd reports POLLERR or POLLHUP.
  AbortWatch(Loop& loop, PendingWork& work, absl::AnyInvocable<void()> on_aborted);
  ~AbortWatch();
  AbortWatch(const AbortWatch&) = delete;
  AbortWatch& operator=(const AbortWatch&) = delete;

  // Watches `fd` (borrowed: kept open by the caller until Stop or the report); a watch on an
  // earlier fd ends quietly.
  void Watch(int fd);
  // Ends the current watch quietly.
  void Stop();
  bool watching() const { return current_ != nullptr; }

 private:
  struct Slot {
    Completion completion;
    bool in_flight = false;
  };
  void Arm(Slot* slot, int fd);

  Loop& loop_;
  PendingWork& work_;
  absl::AnyInvocable<void()> on_aborted_;
  // Slots with stable addresses: a watch on a replaced fd can still be completing while the next
  // one is armed.
  std::vector<std::unique_ptr<Slot>> slots_;
  Slot* current_ = nullptr;
  int fd_ = -1;
};

}  // namespace fusekeeper
