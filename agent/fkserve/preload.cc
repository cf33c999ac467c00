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
// Go programs (go-fuse, bazil) exec fusermount from $PATH, where the launcher puts fkserve's
// first; they do not need this library. Static binaries ignore LD_PRELOAD.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

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

}  // namespace

extern "C" {

ssize_t splice(int fd_in, loff_t* off_in, int fd_out, loff_t* off_out, size_t len, unsigned int flags) {
  static auto real = Next<ssize_t (*)(int, loff_t*, int, loff_t*, size_t, unsigned int)>("splice");
  if (off_out != nullptr || !IsSeqpacketSocket(fd_out)) return real(fd_in, off_in, fd_out, off_out, len, flags);
  char* buf = static_cast<char*>(malloc(len > 0 ? len : 1));
  if (buf == nullptr) {
    errno = ENOMEM;
    return -1;
  }
  size_t got = 0;
  while (got < len) {
    const ssize_t n = off_in != nullptr ? pread(fd_in, buf + got, len - got, *off_in + static_cast<loff_t>(got))
                                        : read(fd_in, buf + got, len - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (off_in != nullptr) *off_in += static_cast<loff_t>(got);
  ssize_t sent;
  do {
    sent = send(fd_out, buf, got, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  const int err = errno;
  free(buf);
  errno = err;
  return sent;
}

int execve(const char* path, char* const argv[], char* const envp[]) {
  static auto real = Next<int (*)(const char*, char* const[], char* const[])>("execve");
  return real(Redirect(path), argv, envp);
}

int execv(const char* path, char* const argv[]) {
  static auto real = Next<int (*)(const char*, char* const[])>("execv");
  return real(Redirect(path), argv);
}

int execvp(const char* file, char* const argv[]) {
  static auto real = Next<int (*)(const char*, char* const[])>("execvp");
  return real(Redirect(file), argv);
}

int execvpe(const char* file, char* const argv[], char* const envp[]) {
  static auto real = Next<int (*)(const char*, char* const[], char* const[])>("execvpe");
  return real(Redirect(file), argv, envp);
}

int posix_spawn(pid_t* pid, const char* path, const posix_spawn_file_actions_t* actions,
                const posix_spawnattr_t* attr, char* const argv[], char* const envp[]) {
  static auto real = Next<int (*)(pid_t*, const char*, const posix_spawn_file_actions_t*, const posix_spawnattr_t*,
                                  char* const[], char* const[])>("posix_spawn");
  return real(pid, Redirect(path), actions, attr, argv, envp);
}

int posix_spawnp(pid_t* pid, const char* file, const posix_spawn_file_actions_t* actions,
                 const posix_spawnattr_t* attr, char* const argv[], char* const envp[]) {
  static auto real = Next<int (*)(pid_t*, const char*, const posix_spawn_file_actions_t*, const posix_spawnattr_t*,
                                  char* const[], char* const[])>("posix_spawnp");
  return real(pid, Redirect(file), actions, attr, argv, envp);
}

#define FKSERVE_OPEN(name)                                                    \
  int name(const char* path, int flags, ...) {                                \
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
