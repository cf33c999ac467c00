#include "agent/sys/syscalls.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

namespace fusekeeper::sys {
namespace {

// Linux UAPI values (include/uapi/linux/mount.h, stat.h) newer than Debian 12's headers.
constexpr long kSysStatmount = 457;  // x86_64, arm64 and most others share the unified table
constexpr uint32_t kStatxMntIdUnique = 0x4000;
constexpr uint64_t kStatmountSbBasic = 0x1, kStatmountMntBasic = 0x2, kStatmountMntRoot = 0x8,
                   kStatmountMntPoint = 0x10, kStatmountFsType = 0x20;

struct MntIdReq {
  uint32_t size;
  uint32_t spare;
  uint64_t mnt_id;
  uint64_t param;
};

// Layout of struct statmount as of 6.8 (later kernels only name spare fields).
struct Statmount {
  uint32_t size;
  uint32_t spare1;
  uint64_t mask;
  uint32_t sb_dev_major;
  uint32_t sb_dev_minor;
  uint64_t sb_magic;
  uint32_t sb_flags;
  uint32_t fs_type;
  uint64_t mnt_id;
  uint64_t mnt_parent_id;
  uint32_t mnt_id_old;
  uint32_t mnt_parent_id_old;
  uint64_t mnt_attr;
  uint64_t mnt_propagation;
  uint64_t mnt_peer_group;
  uint64_t mnt_master;
  uint64_t propagate_from;
  uint32_t mnt_root;
  uint32_t mnt_point;
  uint64_t spare2[50];
  char str[];
};

}  // namespace

int OpenAt2(int dirfd, const char* path, uint64_t flags, uint64_t mode, uint64_t resolve) {
  open_how how{};
  how.flags = flags;
  how.mode = mode;
  how.resolve = resolve;
  return static_cast<int>(syscall(SYS_openat2, dirfd, path, &how, sizeof(how)));
}

int StatxUniqueMountId(int dirfd, const char* path, uint64_t* mnt_id) {
  struct statx stx{};
  // AT_STATX_DONT_SYNC: a FUSE file system then answers from its cache instead of asking its
  // server, so this never blocks on a FUSE mount whose server is dead or not started yet. The
  // mount id and device come from the VFS, not the file system.
  int flags = AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT | AT_STATX_DONT_SYNC |
              (path[0] == '\0' ? AT_EMPTY_PATH : 0);
  if (statx(dirfd, path, flags, kStatxMntIdUnique, &stx) != 0) return -1;
  if ((stx.stx_mask & kStatxMntIdUnique) == 0) {
    errno = EOPNOTSUPP;
    return -1;
  }
  *mnt_id = stx.stx_mnt_id;
  return 0;
}

int StatxTypeNoSync(int dirfd, const char* path, mode_t* type) {
  struct statx stx{};
  int flags = AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT | AT_STATX_DONT_SYNC |
              (path[0] == '\0' ? AT_EMPTY_PATH : 0);
  if (statx(dirfd, path, flags, STATX_TYPE, &stx) != 0) return -1;
  *type = stx.stx_mode & S_IFMT;
  return 0;
}

int StatMount(uint64_t mnt_id, MountFacts* out) {
  MntIdReq req{sizeof(MntIdReq), 0, mnt_id,
               kStatmountSbBasic | kStatmountMntBasic | kStatmountMntRoot | kStatmountMntPoint |
                   kStatmountFsType};
  std::vector<char> buf(sizeof(Statmount) + 4096);
  while (true) {
    long r = syscall(kSysStatmount, &req, buf.data(), buf.size(), 0);
    if (r == 0) break;
    if (errno == EOVERFLOW && buf.size() < (1u << 20)) {
      buf.resize(buf.size() * 4);
      continue;
    }
    return -1;
  }
  const auto* sm = reinterpret_cast<const Statmount*>(buf.data());
  out->mnt_id = sm->mnt_id;
  out->parent_id = sm->mnt_parent_id;
  out->old_id = sm->mnt_id_old;
  out->dev_major = sm->sb_dev_major;
  out->dev_minor = sm->sb_dev_minor;
  out->attr = sm->mnt_attr;
  out->propagation = sm->mnt_propagation;
  out->peer_group = sm->mnt_peer_group;
  out->master = sm->mnt_master;
  out->fs_type = (sm->mask & kStatmountFsType) ? sm->str + sm->fs_type : "";
  out->root = (sm->mask & kStatmountMntRoot) ? sm->str + sm->mnt_root : "";
  out->mount_point = (sm->mask & kStatmountMntPoint) ? sm->str + sm->mnt_point : "";
  return 0;
}

bool HaveStatmount() {
  static const bool have = [] {
    uint64_t id = 0;
    if (StatxUniqueMountId(AT_FDCWD, "/", &id) != 0) return false;
    MountFacts facts;
    return StatMount(id, &facts) == 0;
  }();
  return have;
}

}  // namespace fusekeeper::sys
