// Relay: RelayCore on a loop (agent/loop), between the kernel's /dev/fuse connection and the
// socket of whichever program instance serves it now. The launcher runs it on its own loop, which
// waits with epoll (launcher.cc says why); on a loop of its own (tests, benchmarks) it takes the
// ring where io_uring is allowed and epoll where it is refused (LoopOptions::epoll_without_ring).
// The relay only polls, so nothing else changes between the two.
//
//  - The kernel's connection is made non-blocking and drained with read(2) (into a buffer of the
//    largest message) whenever a multishot POLL on the ring says it is readable: an io_uring READ
//    of /dev/fuse may run inline and sleep in the loop thread (relay.cc). Replies and
//    notifications are written to it directly (a write to /dev/fuse never blocks: the kernel
//    takes the reply or refuses it at once).
//  - The program's end is a SOCK_SEQPACKET socket (one FUSE message per send, as the device
//    has): received with a multishot POLL and non-blocking recv; sent with non-blocking sendmsg,
//    queued (copied) while the program is not reading, flushed on POLLOUT.
//  - A new instance gets a new socket pair (NewInstanceSocket); the old one is closed, and what
//    the old instance had not answered is sent again (RelayCore).
//
// Threading: on a loop of its own (a thread), Start/NewInstanceSocket/Snapshot/Stop from any one
// other thread; on its owner's loop (Start's `loop`), every method from that loop's thread, where
// the blocking ones run at once. Everything else runs on the loop thread, the callbacks too.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"
#include "agent/fkserve/relay/relay_core.h"
#include "agent/loop/loop.h"

namespace fusekeeper::relay {

struct RelayCallbacks {
  std::function<void(const std::string&)> log;
  // The kernel's connection ended (unmounted, or aborted): nothing is left to serve.
  std::function<void()> connection_ended;
  // The first answer of a new instance reached the kernel, `since_start` after it was attached.
  std::function<void(std::chrono::nanoseconds since_start, const RelayStats&)> first_answer;
  // The current instance is not answering (ProgramLimits): `why` says how; `initialized`: the
  // kernel's FUSE_INIT had been answered (by this instance or an earlier one). Its owner is to
  // end it (every process of it); the relay then sends what it had not answered to the next
  // one. Once per instance.
  std::function<void(const std::string& why, bool initialized)> program_unresponsive;
  // When the program's processes last did work (CPU time, bytes read or written: the launcher
  // measures it, program_work.h). An instance that sends nothing while it works is busy, not
  // hung: the stall counts from the later of its last message and its last work. None: not asked.
  std::function<LoopClock::time_point()> last_work;
};

// When an instance counts as not answering (RelayCallbacks::program_unresponsive). Zero: no
// bound.
struct ProgramLimits {
  // The kernel's FUSE_INIT not answered this long after the instance was attached (before any
  // instance has answered it: later instances get the relay's copy, and fall under the stall).
  std::chrono::milliseconds init_timeout{0};
  // Requests in flight to the instance (lock waits, FUSE_SETLKW, aside: those may last) and no
  // message from it for this long, once the kernel's FUSE_INIT was answered.
  std::chrono::milliseconds stall{0};
};

class Relay {
 public:
  // Takes a dup of `kernel_fd` (the /dev/fuse connection). Sizes the program's messages from
  // the socket buffers it can get (net.core.wmem_max caps them): max_write follows.
  // `state`: a dead launcher's relay state (relay_state.h) to carry on from; the kernel is then
  // asked to resend what that launcher had read and not answered (FUSE_NOTIFY_RESEND, Linux
  // 6.9+). Invalid: a new connection, and a new state memfd. An unreadable state, or a kernel
  // that cannot resend, is an error (INVALID_ARGUMENT, FAILED_PRECONDITION): the caller asks
  // for a fresh connection instead.
  // `durability`: when the program makes a change durable (durability.h; RelayCore).
  // `loop`: its owner's loop (made with epoll_without_ring), which the owner runs, and after whose
  // Run the relay is stopped; none: a loop and a thread of its own.
  static absl::StatusOr<std::unique_ptr<Relay>> Start(int kernel_fd, RelayCallbacks callbacks,
                                                      UniqueFd state = UniqueFd(),
                                                      Durability durability = Durability::kAtSync,
                                                      Loop* loop = nullptr);
  ~Relay();
  Durability durability() const { return durability_; }

  // Blocking (waits for the loop to take it). A socket pair for the next program instance: the
  // relay's end is attached now (the instance before it, if any, is gone); the returned end
  // (close-on-exec) is the program's.
  absl::StatusOr<UniqueFd> NewInstanceSocket();
  // Blocking (waits for the loop to take it). From now on instances that do not answer within
  // `limits` are reported (RelayCallbacks::program_unresponsive). Before the first
  // NewInstanceSocket.
  void WatchPrograms(ProgramLimits limits);
  // Blocking. The core's figures now.
  RelayStats Snapshot();

  // The relay's core inside the program (in_program.h): the current instance's preload library
  // asks to read and write the kernel's connection itself. Blocking; granted only while the
  // instance has sent nothing (so nothing it answered is the relay's to know): the relay then
  // stops reading the kernel (what it read and did not answer, the FUSE_INIT among it, stays in
  // the kernel's processing queue: the instance's core has it resent) and stops watching the
  // instance. Its socket is kept open, unread, until the next instance.
  // `pulse`: a dup of the memfd (one page, relay/pulse.h) where the instance's core says how it
  // is doing; the relay watches the instance through it (and through the kernel's queue).
  bool HandOver(UniqueFd* pulse);
  // Blocking. The handed-over instance is gone: the relay carries on from the state its core
  // left in the journal (as a new launcher would: nodes and handles restored, the kernel asked to
  // resend what the instance had read), ready for the next NewInstanceSocket. An error if the
  // connection has ended (UNAVAILABLE) or the journal cannot be read.
  absl::Status TakeBack();
  size_t max_message_bytes() const { return max_message_; }
  // The state memfd (to deposit with the agent); valid while the relay lives (a TakeBack may
  // change the number: dup it).
  int state_fd() const { return state_fd_; }
  // What Start restored: nodes and open handles.
  size_t restored_nodes() const { return restored_nodes_; }
  size_t restored_handles() const { return restored_handles_; }
  void Stop();

 private:
  Relay() = default;
  struct LoopState;
  size_t max_message_ = 0;
  int state_fd_ = -1;
  Durability durability_ = Durability::kAtSync;
  size_t restored_nodes_ = 0, restored_handles_ = 0;
  std::unique_ptr<LoopState> state_;
  std::thread thread_;
  bool stopped_ = false;
};

}  // namespace fusekeeper::relay
