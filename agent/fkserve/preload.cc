// libfkserve_preload.so: loaded (LD_PRELOAD) into programs `fkserve launch` runs, so that a FUSE
// library finds fkserve's fusermount (fusermount.h) although it asks for the system's by
// absolute path, and finds a FUSE device where the container has none.
//
//  - libfuse2 execs FUSERMOUNT_DIR "/fusermount" (Debian: /bin/fusermount) before trying $PATH,
//    and libfuse3 /usr/bin/fusermount3: an exec (execv, execve, execvp, execvpe, posix_spawn,
//    posix_spawnp) of any file named fusermount or fusermount3 runs $FKSERVE_FUSERMOUNT instead.
//  - libfuse opens /dev/fuse and tries mount(2) before it falls back to fusermount, and stops
//    with "fuse: device not found" when the open fails (an unprivileged container has no such
//    device). If opening /dev/fuse fails, a dup of the volume's connection ($FKSERVE_FUSE_FD) is
//    returned: mount(2) then fails with EPERM and libfuse asks fusermount, as it should.
//  - Relayed (fkserve launch's default), the program's connection is a SOCK_SEQPACKET socket,
//    where each FUSE message must be one socket message. libfuse splices large replies (READ)
//    from a pipe when the program asks for FUSE_CAP_SPLICE_WRITE (fuse-overlayfs does: libfuse
//    offers splice whatever the kernel's INIT says), and a splice into a socket sends a message
//    per pipe buffer, so the reply would arrive in pieces. A splice into a SOCK_SEQPACKET socket
//    is done here instead as a read of the pipe and one send.
//  - The relay's core runs here, in the program (relay/in_program.h): at the program's first read
//    of its connection (the launcher's socket, $FKSERVE_RELAY_SOCKET), the library claims the
//    kernel's connection from the launcher; from then on read/readv/write/writev of that fd (and
//    a splice of a reply into it) go through the core. A FUSE_DEV_IOC_CLONE of it is refused
//    (libfuse3's clone_fd then goes on with the one fd). Refused or failed, the program stays on
//    the socket: relayed by the launcher.
// Go programs (go-fuse, bazil) exec fusermount from $PATH, where the launcher puts fkserve's
// first; they do not need this library. Static binaries ignore LD_PRELOAD: they stay relayed.
// Only the interposed functions are exported (built with -fvisibility=hidden).
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <linux/ioctl.h>
#include <pthread.h>
#include <sys/uio.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agent/fkserve/fusermount_protocol.h"
#include "agent/fkserve/relay/in_program.h"

#define FK_EXPORT __attribute__((visibility("default")))

namespace {

const char* Redirect(const char* path) {
  if (path == nullptr) return path;
  const char* base = strrchr(path, '/');
  base = base == nullptr ? path : base + 1;
  if (strcmp(base, "fusermount") != 0 && strcmp(base, "fusermount3") != 0) return path;
  const char* ours = getenv("FKSERVE_FUSERMOUNT");
  return ours != nullptr && ours[0] != '\0' ? ours : path;
}

// A dup of the volume's connection for an open of /dev/fuse that failed, or -1.
int FuseFallback(const char* path, int failed_errno) {
  if (path == nullptr || strcmp(path, "/dev/fuse") != 0) return -1;
  const char* text = getenv("FKSERVE_FUSE_FD");
  if (text == nullptr) return -1;
  char* end = nullptr;
  long fd = strtol(text, &end, 10);
  if (end == text || *end != '\0' || fd < 0) return -1;
  int dup = fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 3);
  if (dup < 0) errno = failed_errno;
  return dup;
}

template <typename F>
F Next(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

bool IsSeqpacketSocket(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  int type = 0;
  socklen_t len = sizeof(type);
  return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_SEQPACKET;
}

// The relay's core in this process, once claimed (never freed: the program may read until exit).
fusekeeper::relay::InProgram* in_program = nullptr;
std::atomic<int> conn_fd{-1};        // the program's connection fd, once claimed
std::atomic<bool> claim_done{false};  // claimed, refused, or not for this process
pthread_mutex_t claim_mu = PTHREAD_MUTEX_INITIALIZER;
unsigned long long relay_ino = 0;  // $FKSERVE_RELAY_SOCKET

__attribute__((constructor)) void ReadEnvironment() {
  const char* text = getenv(fusekeeper::relay::kRelaySocketEnv);
  if (text == nullptr || text[0] == '\0') {
    claim_done = true;
    return;
  }
  relay_ino = strtoull(text, nullptr, 10);
  if (relay_ino == 0) claim_done = true;
}

// At a read of `fd` that may be the program's first of its connection: claims the kernel's
// connection if it is. True if `fd` is now served in the program.
bool MaybeClaim(int fd, size_t count) {
  // The kernel insists on reads of at least FUSE_MIN_READ_BUFFER from a connection; smaller
  // ones are someone else's.
  if (claim_done.load(std::memory_order_relaxed) || count < FUSE_MIN_READ_BUFFER) return false;
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_ino != relay_ino) return false;
  pthread_mutex_lock(&claim_mu);
  if (!claim_done) {
    const char* service = getenv(fusekeeper::kServiceSocketEnv);
    std::string why;
    auto p = fusekeeper::relay::InProgram::Claim(service != nullptr ? service : "", fd, count, &why);
    if (p) {
      in_program = p.release();
      conn_fd = fd;
    } else {
      fprintf(stderr, "fkserve: the relay stays in the launcher for this instance: %s\n", why.c_str());
    }
    claim_done = true;
  }
  pthread_mutex_unlock(&claim_mu);
  return conn_fd.load() == fd;
}

bool Ours(int fd) { return fd >= 0 && conn_fd.load(std::memory_order_relaxed) == fd; }

ssize_t ReadVector(int fd, const iovec* iov, int iovcnt) {
  size_t total = 0;
  for (int i = 0; i < iovcnt; ++i) total += iov[i].iov_len;
  if (iovcnt == 1) return in_program->Read(iov[0].iov_base, iov[0].iov_len);
  std::vector<char> buf(total);
  const ssize_t n = in_program->Read(buf.data(), total);
  if (n <= 0) return n;
  size_t at = 0;
  for (int i = 0; i < iovcnt && at < static_cast<size_t>(n); ++i) {
    const size_t take = std::min(iov[i].iov_len, static_cast<size_t>(n) - at);
    memcpy(iov[i].iov_base, buf.data() + at, take);
    at += take;
  }
  return n;
}

}  // namespace

extern "C" {

FK_EXPORT ssize_t read(int fd, void* buf, size_t count) {
  static auto real = Next<ssize_t (*)(int, void*, size_t)>("read");
  if (Ours(fd) || MaybeClaim(fd, count)) return in_program->Read(buf, count);
  return real(fd, buf, count);
}

FK_EXPORT ssize_t __read_chk(int fd, void* buf, size_t count, size_t buflen) {
  static auto real = Next<ssize_t (*)(int, void*, size_t, size_t)>("__read_chk");
  if (Ours(fd) || MaybeClaim(fd, count)) return in_program->Read(buf, count);
  return real(fd, buf, count, buflen);
}

FK_EXPORT ssize_t readv(int fd, const iovec* iov, int iovcnt) {
  static auto real = Next<ssize_t (*)(int, const iovec*, int)>("readv");
  if (Ours(fd)) return ReadVector(fd, iov, iovcnt);
  if (iovcnt > 0) {
    size_t total = 0;
    for (int i = 0; i < iovcnt; ++i) total += iov[i].iov_len;
    if (MaybeClaim(fd, total)) return ReadVector(fd, iov, iovcnt);
  }
  return real(fd, iov, iovcnt);
}

FK_EXPORT ssize_t write(int fd, const void* buf, size_t count) {
  static auto real = Next<ssize_t (*)(int, const void*, size_t)>("write");
  if (!Ours(fd)) return real(fd, buf, count);
  iovec iov{const_cast<void*>(buf), count};
  return in_program->Write(&iov, 1);
}

FK_EXPORT ssize_t writev(int fd, const iovec* iov, int iovcnt) {
  static auto real = Next<ssize_t (*)(int, const iovec*, int)>("writev");
  if (!Ours(fd)) return real(fd, iov, iovcnt);
  return in_program->Write(iov, iovcnt);
}

FK_EXPORT int ioctl(int fd, unsigned long request, ...) {
  static auto real = Next<int (*)(int, unsigned long, ...)>("ioctl");
  va_list ap;
  va_start(ap, request);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  // A clone of the connection would read the kernel past the core.
  if (request == FUSE_DEV_IOC_CLONE && arg != nullptr && conn_fd.load() >= 0 &&
      *static_cast<const uint32_t*>(arg) == static_cast<uint32_t>(conn_fd.load())) {
    errno = EINVAL;
    return -1;
  }
  return real(fd, request, arg);
}

FK_EXPORT ssize_t splice(int fd_in, loff_t* off_in, int fd_out, loff_t* off_out, size_t len, unsigned int flags) {
  static auto real = Next<ssize_t (*)(int, loff_t*, int, loff_t*, size_t, unsigned int)>("splice");
  if (Ours(fd_in)) {
    errno = EINVAL;  // never offered (the INIT the program sees has no splice)
    return -1;
  }
  const bool ours = Ours(fd_out);
  if (!ours && (off_out != nullptr || !IsSeqpacketSocket(fd_out))) return real(fd_in, off_in, fd_out, off_out, len, flags);
  // A READ's reply into the kernel's connection, the core in the program: spliced on, not copied.
  if (ours && off_in == nullptr) {
    if (const std::optional<ssize_t> sent = in_program->SpliceReply(fd_in, len); sent.has_value()) return *sent;
  }
  // One buffer per thread, kept (a fresh one per reply would fault its pages in every time).
  thread_local std::vector<char> reused;
  if (reused.size() < len) reused.resize(len);
  char* buf = reused.data();
  size_t got = 0;
  while (got < len) {
    const ssize_t n = off_in != nullptr ? pread(fd_in, buf + got, len - got, *off_in + static_cast<loff_t>(got))
                                        : read(fd_in, buf + got, len - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (off_in != nullptr) *off_in += static_cast<loff_t>(got);
  if (ours) {
    iovec iov{buf, got};
    return in_program->Write(&iov, 1);
  }
  ssize_t sent;
  do {
    sent = send(fd_out, buf, got, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  return sent;
}

FK_EXPORT int execve(const char* path, char* const argv[], char* const envp[]) {
  static auto real = Next<int (*)(const char*, char* const[], char* const[])>("execve");
  return real(Redirect(path), argv, envp);
}

FK_EXPORT int execv(const char* path, char* const argv[]) {
  static auto real = Next<int (*)(const char*, char* const[])>("execv");
  return real(Redirect(path), argv);
}

FK_EXPORT int execvp(const char* file, char* const argv[]) {
  static auto real = Next<int (*)(const char*, char* const[])>("execvp");
  return real(Redirect(file), argv);
}

FK_EXPORT int execvpe(const char* file, char* const argv[], char* const envp[]) {
  static auto real = Next<int (*)(const char*, char* const[], char* const[])>("execvpe");
  return real(Redirect(file), argv, envp);
}

FK_EXPORT int posix_spawn(pid_t* pid, const char* path, const posix_spawn_file_actions_t* actions,
                const posix_spawnattr_t* attr, char* const argv[], char* const envp[]) {
  static auto real = Next<int (*)(pid_t*, const char*, const posix_spawn_file_actions_t*, const posix_spawnattr_t*,
                                  char* const[], char* const[])>("posix_spawn");
  return real(pid, Redirect(path), actions, attr, argv, envp);
}

FK_EXPORT int posix_spawnp(pid_t* pid, const char* file, const posix_spawn_file_actions_t* actions,
                 const posix_spawnattr_t* attr, char* const argv[], char* const envp[]) {
  static auto real = Next<int (*)(pid_t*, const char*, const posix_spawn_file_actions_t*, const posix_spawnattr_t*,
                                  char* const[], char* const[])>("posix_spawnp");
  return real(pid, Redirect(file), actions, attr, argv, envp);
}

#define FKSERVE_OPEN(name)                                                    \
  FK_EXPORT int name(const char* path, int flags, ...) {                      \
    static auto real = Next<int (*)(const char*, int, ...)>(#name);           \
    mode_t mode = 0;                                                          \
    if (flags & (O_CREAT | O_TMPFILE)) {                                      \
      va_list ap;                                                             \
      va_start(ap, flags);                                                    \
      mode = va_arg(ap, mode_t);                                              \
      va_end(ap);                                                             \
    }                                                                         \
    int fd = real(path, flags, mode);                                         \
    if (fd >= 0) return fd;                                                   \
    const int err = errno;                                                    \
    int fallback = FuseFallback(path, err);                                   \
    if (fallback >= 0) return fallback;                                       \
    errno = err;                                                              \
    return -1;                                                                \
  }
FKSERVE_OPEN(open)
FKSERVE_OPEN(open64)
#undef FKSERVE_OPEN

}  // extern "C"
