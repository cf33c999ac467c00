#include "agent/mount/mount_ops.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "agent/base/status.h"
#include "agent/mount/mountinfo.h"

namespace fusekeeper {
namespace {

std::string FdPath(int fd) { return absl::StrCat("/proc/self/fd/", fd); }

}  // namespace

absl::Status BindMountFdBlocking(int source_fd, int target_fd, const BindOptions& options,
                                 const std::string& what, const std::string& target_path) {
  unsigned clone_flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH;
  if (options.recursive) clone_flags |= AT_RECURSIVE;
  UniqueFd tree(open_tree(source_fd, "", clone_flags));
  if (!tree) return ErrnoStatus(errno, "open_tree(OPEN_TREE_CLONE)", what);

  mount_attr attr{};
  if (options.read_only) attr.attr_set |= MOUNT_ATTR_RDONLY;
  if (options.nosuid) attr.attr_set |= MOUNT_ATTR_NOSUID;
  if (options.nodev) attr.attr_set |= MOUNT_ATTR_NODEV;
  if (options.noexec) attr.attr_set |= MOUNT_ATTR_NOEXEC;
  if (attr.attr_set != 0) {
    unsigned flags = AT_EMPTY_PATH | (options.recursive ? AT_RECURSIVE : 0);
    if (mount_setattr(tree.get(), "", flags, &attr, sizeof(attr)) != 0) {
      return ErrnoStatus(errno, "mount_setattr on the bind of", what);
    }
  }
  if (options.follow_source) {
    const unsigned flags = AT_EMPTY_PATH | (options.recursive ? AT_RECURSIVE : 0);
    for (uint64_t propagation : {uint64_t{MS_SLAVE}, uint64_t{MS_SHARED}}) {
      mount_attr prop{};
      prop.propagation = propagation;
      if (mount_setattr(tree.get(), "", flags, &prop, sizeof(prop)) != 0) {
        return ErrnoStatus(errno, "mount_setattr(propagation) on the bind of", what);
      }
    }
  }
  if (move_mount(tree.get(), "", target_fd, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) != 0) {
    return ErrnoStatus(errno, absl::StrCat("move_mount of ", what, " onto"), target_path);
  }
  return absl::OkStatus();
}

absl::Status UnmountAtBlocking(int parent_fd, const std::string& name, const std::string& path,
                               int busy_retries) {
  // The parent is pinned by its fd (a magic link, looked up without a path walk from /); only the
  // last component is resolved, and UMOUNT_NOFOLLOW refuses a symlink planted there.
  const std::string via = absl::StrCat(FdPath(parent_fd), "/", name);
  for (int attempt = 0;; ++attempt) {
    if (umount2(via.c_str(), UMOUNT_NOFOLLOW) == 0) return absl::OkStatus();
    if (errno == EINVAL) return absl::NotFoundError(absl::StrCat(path, " is not a mount point"));
    if (errno != EBUSY) return ErrnoStatus(errno, "umount", path);
    if (attempt >= busy_retries) break;
  }
  // Still busy (a process has files open there): detach it now; the kernel frees it when unused.
  if (umount2(via.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW) == 0) return absl::OkStatus();
  return ErrnoStatus(errno, "umount(MNT_DETACH)", path);
}

absl::Status SetReadOnlyFdBlocking(int fd, bool read_only, const std::string& path) {
  mount_attr attr{};
  if (read_only) {
    attr.attr_set = MOUNT_ATTR_RDONLY;
  } else {
    attr.attr_clr = MOUNT_ATTR_RDONLY;
  }
  if (mount_setattr(fd, "", AT_EMPTY_PATH, &attr, sizeof(attr)) != 0) {
    return ErrnoStatus(errno, read_only ? "remount read-only" : "remount read-write", path);
  }
  return absl::OkStatus();
}

absl::Status SetPropagationFdBlocking(int fd, uint64_t propagation, const std::string& path) {
  mount_attr attr{};
  attr.propagation = propagation;
  if (mount_setattr(fd, "", AT_EMPTY_PATH, &attr, sizeof(attr)) != 0) {
    return ErrnoStatus(errno, "mount_setattr(propagation)", path);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<sys::MountFacts>> LookupMountAtBlocking(int fd,
                                                                     const std::string& path) {
  if (sys::HaveStatmount()) {
    uint64_t id = 0;
    if (sys::StatxUniqueMountId(fd, "", &id) != 0) return ErrnoStatus(errno, "statx", path);
    sys::MountFacts facts;
    if (sys::StatMount(id, &facts) != 0) return ErrnoStatus(errno, "statmount", path);
    if (facts.mount_point != path) return std::optional<sys::MountFacts>();
    return std::optional<sys::MountFacts>(std::move(facts));
  }
  std::ifstream in("/proc/self/mountinfo");
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<MountTable> table = MountTable::Parse(text.str());
  if (!table.ok()) return table.status();
  const MountEntry* top = table->FindTop(path);
  if (top == nullptr) return std::optional<sys::MountFacts>();
  return std::optional<sys::MountFacts>(FactsOf(*top));
}

sys::MountFacts FactsOf(const MountEntry& e) {
  sys::MountFacts facts;
  facts.old_id = e.id;
  facts.dev_major = e.major;
  facts.dev_minor = e.minor;
  facts.attr = e.read_only() ? MOUNT_ATTR_RDONLY : 0;
  facts.peer_group = e.shared;
  facts.master = e.master;
  facts.fs_type = std::string(e.fs_type);
  facts.root = std::string(e.root);
  facts.mount_point = std::string(e.mount_point);
  return facts;
}

}  // namespace fusekeeper
