// A seccomp filter that refuses io_uring as container runtimes' default profiles do
// (containerd 2.0+, Docker 25+, CRI-O/Podman): io_uring_setup, io_uring_enter and
// io_uring_register fail with EPERM, everything else is allowed.
//
// Installed in the calling thread (and what it starts or execs from then on); it sets
// no_new_privs, as a runtime does for a container. Async-signal-safe: callable in a child between
// fork and exec.
#pragma once

#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include <cerrno>

namespace fusekeeper {

// Environment: FUSEKEEPER_NO_IO_URING=1 runs the servers the e2e suites start under this filter.
inline constexpr char kNoIoUringEnv[] = "FUSEKEEPER_NO_IO_URING";

inline bool RefuseIoUring() {
  constexpr unsigned kArch = AUDIT_ARCH_X86_64;
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kArch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),  // another ABI: not ours to judge
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 3, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_enter, 2, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_register, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

}  // namespace fusekeeper
