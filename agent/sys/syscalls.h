// Thin wrappers for syscalls glibc 2.36 does not wrap: openat2 (5.6), statmount (6.8) and statx's
// STATX_MNT_ID_UNIQUE (6.8). Each returns like libc: the result, or -1 with errno set. All may
// block (path lookups) and belong on the BlockingPool, never the loop thread.
#pragma once

#include <linux/openat2.h>
#include <stdint.h>
#include <sys/types.h>

#include <string>

namespace fusekeeper::sys {

int OpenAt2(int dirfd, const char* path, uint64_t flags, uint64_t mode, uint64_t resolve);

// The statmount(2) result we use, decoded. Strings are copied out of the kernel buffer.
struct MountFacts {
  uint64_t mnt_id = 0;         // 64-bit unique id (never reused while the system runs)
  uint64_t parent_id = 0;
  uint32_t old_id = 0;         // the id shown in mountinfo
  uint32_t dev_major = 0, dev_minor = 0;
  uint64_t attr = 0;           // MOUNT_ATTR_* (MOUNT_ATTR_RDONLY...)
  uint64_t propagation = 0;    // MS_SHARED / MS_SLAVE / MS_PRIVATE / MS_UNBINDABLE
  uint64_t peer_group = 0;     // shared:N
  uint64_t master = 0;         // master:N
  std::string fs_type;
  std::string root;
  std::string mount_point;
};

// True if this kernel has statmount and statx(STATX_MNT_ID_UNIQUE) (6.8+). Probed once.
bool HaveStatmount();

// statmount(mnt_id) with basic, root, mount point and fs type. -1/errno on failure.
int StatMount(uint64_t mnt_id, MountFacts* out);

// The unique id of the mount `path` (relative to dirfd) lives on, without following a final
// symlink. For a mount point this is the mount at that point. Never asks a FUSE server
// (AT_STATX_DONT_SYNC). -1/errno on failure.
int StatxUniqueMountId(int dirfd, const char* path, uint64_t* mnt_id);

// The file type bits (S_IFMT) of `path` relative to dirfd (AT_EMPTY_PATH if path is ""),
// without following a final symlink and without asking a FUSE server (AT_STATX_DONT_SYNC): safe on
// a FUSE mount point whose server is absent. -1/errno on failure.
int StatxTypeNoSync(int dirfd, const char* path, mode_t* type);

}  // namespace fusekeeper::sys
