// InProgram: the relay's core (RelayCore) inside the program, in libfkserve_preload.so, so that a
// request costs two wake-ups as on the direct connection instead of the four of a hop through
// the launcher.
//
// Every instance starts relayed (relay.h): its connection is one end of the launcher's socket
// pair. At the program's first read of that socket (identified by its inode, $FKSERVE_RELAY_SOCKET),
// the preload library asks the launcher for the kernel's connection (Claim, on the launcher's
// service socket). The launcher grants it only while the instance has sent nothing, and hands
// over a dup of the kernel's /dev/fuse connection and the relay-state journal (relay_state.h).
// From then on the program's read/readv of its connection fd read the kernel's requests through
// the core here, and its write/writev go through the core to the kernel:
//
//  - The core starts from the journal (Restore: the nodes and handles the kernel holds, kept
//    changes) and asks the kernel to resend what was read and not answered
//    (FUSE_NOTIFY_RESEND): the FUSE_INIT the launcher read for a first instance, or what a dead
//    instance had read. Every program death is then what a launcher death is to the hop: the
//    launcher keeps a dup of the connection, so those requests stay with the kernel.
//  - What the core asks the program itself (its INIT replayed, LOOKUPs of old node ids, reopened
//    handles, kept changes written again) is queued and handed to whichever program thread
//    reads next (an eventfd wakes readers waiting on the kernel).
//  - Any thread may read, any thread may answer: one mutex around the core. Reads wait in
//    poll(2) on the kernel's connection and the eventfd, then read it non-blocking.
//  - The program's own notifications are written by its thread, synchronously, outside the
//    mutex (as on the direct connection); the core's own go through a KernelNotifier thread.
//  - The launcher is told when the instance serves (its first answer, with the core's figures),
//    on the claim's socket, which it reads until the instance ends.
//
// A program the preload library cannot enter (static binaries: Go programs) never claims: it is
// relayed by the launcher as before.
#pragma once

#include <linux/fuse.h>
#include <stddef.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <deque>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <unordered_set>

#include "agent/base/unique_fd.h"
#include "agent/fkserve/relay/kernel_notifier.h"
#include "agent/fkserve/relay/pulse.h"
#include "agent/fkserve/relay/relay_core.h"
#include "agent/fkserve/relay/relay_state.h"

namespace fusekeeper::relay {

// The claim's wire (launcher side: launcher.cc). Request: "claim\n<socket inode>\n<read size>".
// Answer: "ok\n<durability>" with the kernel's connection attached, then "journal" with the
// journal attached, then "pulse" with the pulse (pulse.h) attached; or a refusal (any other
// text, no fd). Then from the program, one message each: kServedReport followed by "<resent>
// <resolved> <reopened> <restore failures> <writes replayed> <files lost>" once it has answered a
// request, and kLogReport followed by a line for every line the core logs.
inline constexpr char kClaimRequest[] = "claim";
inline constexpr char kServedReport[] = "served\n";
inline constexpr char kLogReport[] = "log\n";
inline constexpr char kRelaySocketEnv[] = "FKSERVE_RELAY_SOCKET";  // the instance's socket inode

class InProgram final : public RelayOutput {
 public:
  // `program_fd`: the program's connection (the launcher's socket); `read_size`: the size of the
  // program's read, which bounds every message it is given. Null if the launcher refused or
  // could not be asked (`why` says which): the program goes on over the socket.
  static std::unique_ptr<InProgram> Claim(const std::string& service_socket, int program_fd, size_t read_size,
                                          std::string* why);
  ~InProgram() override;

  // The program's fd, now the kernel's connection (dup2'ed over the socket).
  int fd() const { return program_fd_; }
  // The program's read of its connection: one message. -1 with errno as the device's read.
  ssize_t Read(void* buf, size_t count);
  // The program's write of one message. Returns its length (as the device does).
  ssize_t Write(const iovec* iov, int iovcnt);
  // The program's splice of one message from `pipe` (libfuse's READ replies with
  // FUSE_CAP_SPLICE_WRITE). A READ's reply the core needs only the header of goes on to the
  // kernel by splice too (its data never copied here): the result, as the device's splice.
  // nullopt: not such a reply, the pipe untouched (the caller copies it out and Writes it).
  std::optional<ssize_t> SpliceReply(int pipe, size_t len);

  // RelayOutput (called with mu_ held).
  void ToKernel(const char* data, size_t len) override;
  void ToProgram(const iovec* iov, int iovcnt) override;
  void Log(const std::string& line) override;

 private:
  InProgram() = default;
  ssize_t Pop(void* buf, size_t count);  // mu_ held
  void FromKernel(char* msg, size_t len);  // mu_ held: a request into the core
  void AfterCore();                       // mu_ held: the launcher's report, the pulse
  // A READ's reply the core answered with `header`: written with the program's data, without mu_.
  void WriteReply(const fuse_out_header& header, const iovec* iov, int iovcnt);
  // The same for a spliced one (`as_written`: its header in `pipe`); the device's splice result.
  ssize_t SendSplicedReply(const fuse_out_header& header, const fuse_out_header& as_written, int pipe, size_t len);

  int program_fd_ = -1;
  UniqueFd kernel_;   // our own dup of the connection (non-blocking)
  UniqueFd wake_;     // eventfd: readable while to_program_ is not empty
  UniqueFd report_;   // the claim's socket: what the launcher is told
  std::mutex mu_;
  std::unique_ptr<StateJournal> journal_;
  std::unique_ptr<RelayCore> core_;
  std::unique_ptr<KernelNotifier> notifier_;
  std::deque<std::string> to_program_;
  bool ended_ = false;
  bool reported_ = false;
  Pulse* pulse_ = nullptr;              // shared with the launcher's relay
  std::unordered_set<uint64_t> lock_waits_;  // FUSE_SETLKW in flight: they may last
  // The reading thread's buffer while the core handles what it read: the first message for the
  // program goes straight into it.
  char* direct_ = nullptr;
  size_t direct_cap_ = 0, direct_len_ = 0;
  // A READ's reply: the core is given its header only (RelayCore::HeaderOnlyReply); the data
  // goes to the kernel from the program's own iovecs, written by the replying thread once it has
  // let go of the mutex (header_due_: the core answered with header_), so that the copies of
  // several threads' replies into the kernel overlap, as on the program's own connection.
  fuse_out_header header_{};
  const iovec* header_iov_ = nullptr;
  int header_iovcnt_ = 0;
  bool header_due_ = false;
  // Or a spliced one: the data follows the header in this pipe (SpliceReply); -1 when none.
  int header_pipe_ = -1;
};

}  // namespace fusekeeper::relay
