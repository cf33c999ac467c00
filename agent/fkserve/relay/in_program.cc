#include "agent/fkserve/relay/in_program.h"

#include <fcntl.h>
#include <linux/fuse.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/base/fd_passing.h"
#include "agent/fkserve/fusermount_protocol.h"
#include "agent/fkserve/relay/durability.h"
#include "agent/fkserve/relay/fuse_wire.h"

namespace fusekeeper::relay {
namespace {

// The kernel's connection has ended: unmounted (ENODEV), or aborted (ECONNABORTED, which reads
// get after a fusectl abort). Said as ENODEV, the end every FUSE library takes as a clean one.
bool ConnectionEnded() {
  if (errno == ECONNABORTED) errno = ENODEV;
  return errno == ENODEV;
}

// The preload library interposes read and write: the core's own I/O goes to the kernel directly.
ssize_t RawRead(int fd, void* buf, size_t n) { return syscall(SYS_read, fd, buf, n); }
ssize_t RawWrite(int fd, const void* buf, size_t n) { return syscall(SYS_write, fd, buf, n); }
// And splice: the raw system calls, as the library interposes splice.
ssize_t RawSplice(int in, int out, size_t len, unsigned flags) {
  return syscall(SYS_splice, in, nullptr, out, nullptr, len, flags);
}
ssize_t RawTee(int in, int out, size_t len) { return syscall(SYS_tee, in, out, len, 0u); }

// A pipe of the calling thread's, as large as the program's: a spliced reply is put together in
// it (the core's header, then the program's data) and spliced on to the kernel in one message.
struct ScratchPipe {
  int r = -1, w = -1;
  ~ScratchPipe() {
    if (r >= 0) close(r);
    if (w >= 0) close(w);
  }
  bool Open() {
    if (r >= 0) return true;
    int p[2];
    // Non-blocking to write: should it be full after all, the reply fails rather than hangs.
    if (pipe2(p, O_CLOEXEC) != 0) return false;
    r = p[0];
    w = p[1];
    fcntl(w, F_SETFL, fcntl(w, F_GETFL) | O_NONBLOCK);
    return true;
  }
  // Room for a reply of `len` bytes from the pipe `like` (as many buffers as it has, and one
  // more for the header): false if the pipe cannot be made that large (fs.pipe-max-size).
  bool Fits(int like, size_t len) {
    const int like_size = fcntl(like, F_GETPIPE_SZ);
    if (like_size <= 0) return false;
    const int want = std::max(like_size + 4096, static_cast<int>(len) + 8192);
    return fcntl(w, F_GETPIPE_SZ) >= want || fcntl(w, F_SETPIPE_SZ, want) >= want;
  }
  // Empties it (what a failed step left).
  void Drain() {
    char buf[4096];
    const int fl = fcntl(r, F_GETFL);
    fcntl(r, F_SETFL, fl | O_NONBLOCK);
    while (RawRead(r, buf, sizeof(buf)) > 0) {
    }
    fcntl(r, F_SETFL, fl);
  }
};
thread_local ScratchPipe scratch;

// Reads and drops `len` bytes of `pipe` (a reply the core did not send on).
void Discard(int pipe, size_t len) {
  char buf[4096];
  while (len > 0) {
    const ssize_t n = RawRead(pipe, buf, std::min(len, sizeof(buf)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    len -= static_cast<size_t>(n);
  }
}

// The calling thread is handing the core a notification of the program's own: it is written by
// that thread, after the mutex is released (see the header).
thread_local std::vector<std::string>* own_notifications = nullptr;

// The kernel copies a request into the reader's buffer page by page; where a page is not mapped
// yet it faults it in, and a fault with a fatal signal pending fails, and the request with it: the
// kernel answers the app EIO (fuse_dev_do_read). A program killed with SIGKILL while it reads a
// large WRITE into a fresh buffer cost the app that write (seen: unionfs-fuse under the
// model-checking writer, 1 EIO in 20 kills). Each thread's buffer is touched once, writable,
// before its first read (libfuse reuses it), so the copy never faults.
void Prefault(void* buf, size_t count) {
  thread_local const void* done = nullptr;
  thread_local size_t done_len = 0;
  if (buf == done && count <= done_len) return;
  volatile char* p = static_cast<volatile char*>(buf);
  for (size_t at = 0; at < count; at += 4096) p[at] = 0;
  if (count > 0) p[count - 1] = 0;
  done = buf;
  done_len = count;
}

}  // namespace

std::unique_ptr<InProgram> InProgram::Claim(const std::string& service_socket, int program_fd, size_t read_size,
                                            std::string* why) {
  struct stat st;
  if (fstat(program_fd, &st) != 0) {
    *why = absl::StrCat("fstat of the connection: ", strerror(errno));
    return nullptr;
  }
  UniqueFd sock = ConnectSeqpacket(service_socket);
  if (!sock) {
    *why = absl::StrCat("cannot reach the launcher at ", service_socket, ": ", strerror(errno));
    return nullptr;
  }
  if (!SendWithFd(sock.get(), absl::StrCat(kClaimRequest, "\n", st.st_ino, "\n", read_size), -1)) {
    *why = absl::StrCat("asking the launcher: ", strerror(errno));
    return nullptr;
  }
  std::string text;
  int kfd = -1;
  if (!ReceiveWithFd(sock.get(), &text, &kfd)) {
    *why = absl::StrCat("the launcher's answer: ", strerror(errno));
    return nullptr;
  }
  UniqueFd kernel(kfd);
  const size_t nl = text.find('\n');
  if (!kernel || nl == std::string::npos || text.substr(0, nl) != "ok") {
    *why = absl::StrCat("the launcher refused: ", text);
    return nullptr;
  }
  const std::optional<Durability> durability = ParseDurability(text.substr(nl + 1));
  int jfd = -1;
  if (!durability || !ReceiveWithFd(sock.get(), &text, &jfd) || jfd < 0) {
    if (jfd >= 0) close(jfd);
    *why = "the launcher sent no journal";
    return nullptr;
  }
  UniqueFd journal_fd(jfd);
  int pfd = -1;
  if (!ReceiveWithFd(sock.get(), &text, &pfd) || pfd < 0) {
    *why = "the launcher sent no pulse";
    return nullptr;
  }
  UniqueFd pulse_fd(pfd);
  void* pulse = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, pulse_fd.get(), 0);
  if (pulse == MAP_FAILED) {
    *why = absl::StrCat("mapping the pulse: ", strerror(errno));
    return nullptr;
  }
  SavedState saved;
  auto journal = StateJournal::Open(std::move(journal_fd), &saved);
  if (!journal.ok()) {
    *why = absl::StrCat("the relay state: ", journal.status().message());
    return nullptr;
  }
  std::unique_ptr<InProgram> p(new InProgram());
  p->program_fd_ = program_fd;
  p->pulse_ = static_cast<Pulse*>(pulse);
  p->kernel_ = std::move(kernel);
  p->report_ = std::move(sock);
  p->journal_ = std::move(*journal);
  p->wake_ = UniqueFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  const int fl = fcntl(p->kernel_.get(), F_GETFL);
  if (!p->wake_ || fl < 0 || fcntl(p->kernel_.get(), F_SETFL, fl | O_NONBLOCK) != 0) {
    *why = absl::StrCat("setting up: ", strerror(errno));
    return nullptr;
  }
  InProgram* raw = p.get();
  p->notifier_ = std::make_unique<KernelNotifier>(p->kernel_.get(), [raw](const std::string& l) { raw->Log(l); });
  std::lock_guard<std::mutex> lock(p->mu_);
  p->core_ = std::make_unique<RelayCore>(p.get(), read_size, *durability);
  p->core_->SetJournal(p->journal_.get());
  if (!saved.init_request.empty()) p->core_->Restore(saved);
  // What was read and not answered (the INIT a first instance's relay read, a dead instance's
  // requests) comes again, to this core, and is taken in before the program is: a RENAME the
  // dead instance may have done must be decided (RelayCore::Check) before any request of the
  // new one resolves a path through it (seen: ESTALE on files a rename in flight had moved,
  // sshfs and unionfs-fuse under the model-checking writer, when these arrived after the
  // program's INIT).
  if (const int err = AskKernelToResend(p->kernel_.get()); err != 0) {
    *why = absl::StrCat("asking the kernel to resend (FUSE_NOTIFY_RESEND, Linux 6.9+): ", strerror(err));
    return nullptr;
  }
  std::vector<char> buf(read_size);
  while (true) {
    const ssize_t n = RawRead(p->kernel_.get(), buf.data(), buf.size());
    if (n > 0) {
      p->FromKernel(buf.data(), static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EINTR || errno == ENOENT)) continue;
    if (n < 0 && errno == EAGAIN) break;
    *why = absl::StrCat("reading the kernel's connection: ", n == 0 ? "end of file" : strerror(errno));
    return nullptr;
  }
  p->core_->ProgramStarted();
  // Calls the preload library does not see (poll, ioctl, splice of the program's own) reach the
  // kernel's connection, not a socket nobody reads.
  if (dup3(p->kernel_.get(), program_fd, O_CLOEXEC) < 0) {
    *why = absl::StrCat("dup3 over the program's connection: ", strerror(errno));
    return nullptr;
  }
  return p;
}

InProgram::~InProgram() = default;

ssize_t InProgram::Pop(void* buf, size_t count) {
  std::string& m = to_program_.front();
  if (m.size() > count) {
    errno = EINVAL;  // as the device says to a buffer too small for its message
    return -1;
  }
  const size_t n = m.size();
  memcpy(buf, m.data(), n);
  to_program_.pop_front();
  if (to_program_.empty()) {
    uint64_t v;
    (void)!RawRead(wake_.get(), &v, sizeof(v));
  }
  return static_cast<ssize_t>(n);
}

ssize_t InProgram::Read(void* buf, size_t count) {
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!to_program_.empty()) return Pop(buf, count);
      if (ended_) {
        errno = ENODEV;
        return -1;
      }
    }
    pollfd fds[3] = {{kernel_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}, {report_.get(), POLLRDHUP, 0}};
    if (poll(fds, report_.valid() ? 3 : 2, -1) < 0) return -1;  // EINTR: a signal for the program (libfuse's exit)
    if ((fds[2].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
      // The launcher has ended. The next one carries on from the journal with an instance of its
      // own: this one must not serve on beside it (two cores on one connection). In a container
      // the launcher's end ends every process; a daemonized program outside one, or one forked
      // just as its launcher was killed, ends here.
      static const char kGone[] = "fkserve (in the program): the launcher has ended: this instance stops\n";
      (void)!RawWrite(STDERR_FILENO, kGone, sizeof(kGone) - 1);
      kill(getpid(), SIGKILL);
    }
    if ((fds[0].revents & (POLLIN | POLLERR | POLLHUP)) == 0) continue;
    Prefault(buf, count);
    const ssize_t n = RawRead(kernel_.get(), buf, count);
    if (n < 0) {
      if (errno == EAGAIN || errno == ENOENT) continue;  // another thread took it; withdrawn
      if (ConnectionEnded()) {
        std::lock_guard<std::mutex> lock(mu_);
        ended_ = true;
      }
      return -1;
    }
    std::lock_guard<std::mutex> lock(mu_);
    direct_ = static_cast<char*>(buf);
    direct_cap_ = count;
    direct_len_ = 0;
    FromKernel(static_cast<char*>(buf), static_cast<size_t>(n));
    const size_t got = direct_len_;
    direct_ = nullptr;
    AfterCore();
    if (got > 0) return static_cast<ssize_t>(got);
    // Answered by the core, or held: read on.
  }
}

void InProgram::FromKernel(char* msg, size_t len) {
  // A lock wait may last: it does not make the program look stalled (the pulse).
  if (len >= sizeof(fuse_in_header) && reinterpret_cast<const fuse_in_header*>(msg)->opcode == FUSE_SETLKW) {
    lock_waits_.insert(reinterpret_cast<const fuse_in_header*>(msg)->unique);
  }
  core_->FromKernel(msg, len);
}

ssize_t InProgram::Write(const iovec* iov, int iovcnt) {
  size_t total = 0;
  for (int i = 0; i < iovcnt; ++i) total += iov[i].iov_len;
  if (total > 4096 && iovcnt > 0 && iov[0].iov_len >= sizeof(fuse_out_header)) {
    fuse_out_header h;
    memcpy(&h, iov[0].iov_base, sizeof(h));
    bool taken = false, due = false;
    fuse_out_header out{};
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (h.len == total && h.error == 0 && core_->HeaderOnlyReply(h.unique)) {
        taken = true;
        header_ = h;
        header_iov_ = iov;
        header_iovcnt_ = iovcnt;
        core_->FromProgram(reinterpret_cast<char*>(&header_), total);
        header_iov_ = nullptr;
        due = header_due_;
        header_due_ = false;
        out = header_;
        AfterCore();
      }
    }
    if (taken) {
      if (due) WriteReply(out, iov, iovcnt);
      return static_cast<ssize_t>(total);
    }
  }
  thread_local std::string msg;
  msg.clear();
  for (int i = 0; i < iovcnt; ++i) msg.append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
  std::vector<std::string> notes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (msg.size() >= sizeof(fuse_out_header)) {
      const uint64_t unique = reinterpret_cast<const fuse_out_header*>(msg.data())->unique;
      if (unique == 0) own_notifications = &notes;
      if (!lock_waits_.empty()) lock_waits_.erase(unique);
    }
    core_->FromProgram(msg.data(), msg.size());
    own_notifications = nullptr;
    AfterCore();
  }
  for (const std::string& n : notes) {
    if (RawWrite(kernel_.get(), n.data(), n.size()) < 0) {
      // As the device would have answered the program's own write.
      return -1;
    }
  }
  return static_cast<ssize_t>(msg.size());
}

void InProgram::AfterCore() {
  const int64_t now = MonotonicNs();
  const bool busy = core_->requests_in_flight() > lock_waits_.size();
  if (busy && !pulse_->busy.load(std::memory_order_relaxed)) pulse_->busy_since_ns.store(now, std::memory_order_relaxed);
  pulse_->busy.store(busy ? 1 : 0, std::memory_order_relaxed);
  pulse_->last_activity_ns.store(now, std::memory_order_relaxed);
  if (core_->initialized()) pulse_->init_done.store(1, std::memory_order_relaxed);
  if (reported_ || core_->stats().program_answers_since_start == 0) return;
  reported_ = true;
  const RelayStats& s = core_->stats();
  const std::string text = absl::StrCat(kServedReport, s.resent, " ", s.resolved, " ", s.reopened, " ",
                                        s.restore_failures, " ", s.writes_replayed, " ", s.files_lost);
  (void)!send(report_.get(), text.data(), text.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

std::optional<ssize_t> InProgram::SpliceReply(int pipe, size_t len) {
  if (len <= 4096 || !scratch.Open()) return std::nullopt;
  // The header, seen without taking it from the program's pipe (tee copies buffer references).
  fuse_out_header h;
  if (RawTee(pipe, scratch.w, sizeof(h)) != static_cast<ssize_t>(sizeof(h))) {
    scratch.Drain();
    return std::nullopt;
  }
  if (RawRead(scratch.r, &h, sizeof(h)) != static_cast<ssize_t>(sizeof(h))) {
    scratch.Drain();
    return std::nullopt;
  }
  fuse_out_header out{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (h.len != len || h.error != 0 || !core_->HeaderOnlyReply(h.unique)) return std::nullopt;
    header_ = h;
    header_pipe_ = pipe;
    header_due_ = false;
    core_->FromProgram(reinterpret_cast<char*>(&header_), len);
    header_pipe_ = -1;
    out = header_;
    AfterCore();
    if (!header_due_) {
      // Not sent on (answered already, or the instance is going).
      Discard(pipe, len);
      return static_cast<ssize_t>(len);
    }
    header_due_ = false;
  }
  // Sent after the mutex, as WriteReply: several threads' replies go into the kernel at once.
  return SendSplicedReply(out, h, pipe, len);
}

ssize_t InProgram::SendSplicedReply(const fuse_out_header& header, const fuse_out_header& as_written, int pipe,
                                    size_t len) {
  ssize_t n;
  if (memcmp(&header, &as_written, sizeof(header)) == 0) {
    // The header as the program wrote it: its pipe goes on to the kernel as it is.
    do {
      n = RawSplice(pipe, kernel_.get(), len, SPLICE_F_MOVE);
    } while (n < 0 && errno == EINTR);
    if (n < 0) Discard(pipe, len);
  } else if (!scratch.Fits(pipe, len)) {
    // Too large to be put together in a pipe of ours: copied out, the core's header first.
    thread_local std::vector<char> copy;
    copy.resize(len);
    size_t got = 0;
    while (got < len) {
      const ssize_t m = RawRead(pipe, copy.data() + got, len - got);
      if (m < 0 && errno == EINTR) continue;
      if (m <= 0) break;
      got += static_cast<size_t>(m);
    }
    memcpy(copy.data(), &header, sizeof(header));
    do {
      n = RawWrite(kernel_.get(), copy.data(), got);
    } while (n < 0 && errno == EINTR);
  } else {
    // The core's header, then the program's data moved from its pipe: one message, spliced.
    Discard(pipe, sizeof(fuse_out_header));
    bool ok = RawWrite(scratch.w, &header, sizeof(header)) == static_cast<ssize_t>(sizeof(header));
    for (size_t moved = sizeof(header); ok && moved < len;) {
      const ssize_t m = RawSplice(pipe, scratch.w, len - moved, SPLICE_F_MOVE);
      if (m < 0 && errno == EINTR) continue;
      ok = m > 0;
      if (ok) moved += static_cast<size_t>(m);
    }
    if (!ok) {
      // The scratch pipe could not take it: the kernel gets an error for this request.
      scratch.Drain();
      fuse_out_header e = header;
      e.len = sizeof(e);
      e.error = -EIO;
      (void)!RawWrite(kernel_.get(), &e, sizeof(e));
      return static_cast<ssize_t>(len);
    }
    do {
      n = RawSplice(scratch.r, kernel_.get(), len, SPLICE_F_MOVE);
    } while (n < 0 && errno == EINTR);
    if (n < 0) scratch.Drain();
  }
  if (n < 0 && ConnectionEnded()) {
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
  }
  return n;
}

void InProgram::ToKernel(const char* data, size_t len) {
  if (len >= sizeof(fuse_out_header) && reinterpret_cast<const fuse_out_header*>(data)->unique == 0) {
    if (own_notifications != nullptr) {
      own_notifications->emplace_back(data, len);
    } else {
      notifier_->Push(data, len);  // the core's own: never under the mutex (kernel_notifier.h)
    }
    return;
  }
  if (data == reinterpret_cast<const char*>(&header_) && (header_pipe_ >= 0 || header_iov_ != nullptr)) {
    // A READ's reply: sent by the replying thread after the mutex (WriteReply, SendSplicedReply).
    header_due_ = true;
    return;
  }
  ssize_t n;
  do {
    n = RawWrite(kernel_.get(), data, len);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && ConnectionEnded()) ended_ = true;
}

void InProgram::WriteReply(const fuse_out_header& header, const iovec* iov, int iovcnt) {
  // The header as the core left it, then the program's data after its own header.
  thread_local std::vector<iovec> out;
  out.clear();
  out.push_back({const_cast<fuse_out_header*>(&header), sizeof(header)});
  size_t skip = sizeof(fuse_out_header);
  for (int i = 0; i < iovcnt; ++i) {
    const size_t l = iov[i].iov_len;
    if (skip >= l) {
      skip -= l;
      continue;
    }
    out.push_back({static_cast<char*>(iov[i].iov_base) + skip, l - skip});
    skip = 0;
  }
  ssize_t n;
  do {
    n = syscall(SYS_writev, kernel_.get(), out.data(), static_cast<int>(out.size()));
  } while (n < 0 && errno == EINTR);
  if (n < 0 && ConnectionEnded()) {
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
  }
}

void InProgram::ToProgram(const iovec* iov, int iovcnt) {
  size_t total = 0;
  for (int i = 0; i < iovcnt; ++i) total += iov[i].iov_len;
  if (direct_ != nullptr && direct_len_ == 0 && total <= direct_cap_ && to_program_.empty()) {
    if (iovcnt == 1 && iov[0].iov_base == direct_) {
      direct_len_ = total;  // translated in place
      return;
    }
    bool overlaps = false;
    for (int i = 0; i < iovcnt; ++i) {
      const char* b = static_cast<const char*>(iov[i].iov_base);
      overlaps = overlaps || (b < direct_ + direct_cap_ && b + iov[i].iov_len > direct_);
    }
    if (!overlaps) {
      size_t at = 0;
      for (int i = 0; i < iovcnt; ++i) {
        memcpy(direct_ + at, iov[i].iov_base, iov[i].iov_len);
        at += iov[i].iov_len;
      }
      direct_len_ = total;
      return;
    }
  }
  std::string copy;
  copy.reserve(total);
  for (int i = 0; i < iovcnt; ++i) copy.append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
  const bool was_empty = to_program_.empty();
  to_program_.push_back(std::move(copy));
  if (was_empty) {
    const uint64_t one = 1;
    (void)!RawWrite(wake_.get(), &one, sizeof(one));
  }
}

void InProgram::Log(const std::string& line) {
  // To the launcher, which says it on its own stderr: a program that daemonizes has put
  // /dev/null on its own.
  if (report_.valid()) {
    const std::string text = absl::StrCat(kLogReport, line);
    if (send(report_.get(), text.data(), text.size(), MSG_DONTWAIT | MSG_NOSIGNAL) >= 0) return;
  }
  const std::string text = absl::StrCat("fkserve (in the program): ", line, "\n");
  (void)!RawWrite(STDERR_FILENO, text.data(), text.size());
}

}  // namespace fusekeeper::relay
