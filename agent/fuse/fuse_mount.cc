#include "agent/fuse/fuse_mount.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "agent/base/status.h"

namespace fusekeeper {
namespace {

constexpr char kFuseCtl[] = "/sys/fs/fuse/connections";

absl::Status Config(int fs, const char* key, const std::string& value, const std::string& target) {
  if (fsconfig(fs, FSCONFIG_SET_STRING, key, value.c_str(), 0) != 0) {
    return ErrnoStatus(errno, absl::StrCat("fsconfig(", key, ") for FUSE mount at"), target);
  }
  return absl::OkStatus();
}

absl::Status Flag(int fs, const char* key, const std::string& target) {
  if (fsconfig(fs, FSCONFIG_SET_FLAG, key, nullptr, 0) != 0) {
    return ErrnoStatus(errno, absl::StrCat("fsconfig(", key, ") for FUSE mount at"), target);
  }
  return absl::OkStatus();
}

// mount(2) with the option string: kernels without fs_context support for fuse.
absl::Status LegacyMount(int fuse_fd, int target_fd, const std::string& target,
                         const FuseMountOptions& o) {
  std::string data = absl::StrCat("fd=", fuse_fd, ",rootmode=40000,user_id=", o.user_id,
                                  ",group_id=", o.group_id);
  if (o.allow_other) data += ",allow_other";
  if (o.default_permissions) data += ",default_permissions";
  if (o.max_read > 0) absl::StrAppend(&data, ",max_read=", o.max_read);
  unsigned long flags = MS_NOSUID | MS_NODEV | (o.read_only ? MS_RDONLY : 0) |
                        (o.noexec ? MS_NOEXEC : 0) | (o.noatime ? MS_NOATIME : 0);
  const std::string via = absl::StrCat("/proc/self/fd/", target_fd);
  const std::string type = absl::StrCat("fuse.", o.subtype);
  const std::string source = o.source.empty() ? o.subtype : o.source;
  if (mount(source.c_str(), via.c_str(), type.c_str(), flags, data.c_str()) != 0) {
    return ErrnoStatus(errno, "mount(fuse)", target);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<UniqueFd> OpenFuseDeviceBlocking() {
  int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return ErrnoStatus(errno, "opening /dev/fuse (is the fuse module loaded and /dev/fuse "
                              "mounted into the agent's container?)");
  }
  return UniqueFd(fd);
}

absl::Status MountFuseBlocking(int fuse_fd, int target_fd, const std::string& target,
                               const FuseMountOptions& o) {
  if (o.subtype.empty() || o.subtype.find_first_of(",= \t\n") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("FUSE subtype '", o.subtype, "' is not valid"));
  }
  UniqueFd fs(fsopen("fuse", FSOPEN_CLOEXEC));
  if (!fs) {
    if (errno == ENOSYS || errno == ENODEV || errno == EINVAL) return LegacyMount(fuse_fd, target_fd, target, o);
    return ErrnoStatus(errno, "fsopen(fuse) for", target);
  }
  if (auto s = Config(fs.get(), "fd", std::to_string(fuse_fd), target); !s.ok()) return s;
  if (auto s = Config(fs.get(), "rootmode", "40000", target); !s.ok()) return s;
  if (auto s = Config(fs.get(), "user_id", std::to_string(o.user_id), target); !s.ok()) return s;
  if (auto s = Config(fs.get(), "group_id", std::to_string(o.group_id), target); !s.ok()) return s;
  if (auto s = Config(fs.get(), "subtype", o.subtype, target); !s.ok()) return s;
  if (auto s = Config(fs.get(), "source", o.source.empty() ? o.subtype : o.source, target); !s.ok()) return s;
  if (o.max_read > 0) {
    if (auto s = Config(fs.get(), "max_read", std::to_string(o.max_read), target); !s.ok()) return s;
  }
  if (o.allow_other) {
    if (auto s = Flag(fs.get(), "allow_other", target); !s.ok()) return s;
  }
  if (o.default_permissions) {
    if (auto s = Flag(fs.get(), "default_permissions", target); !s.ok()) return s;
  }
  if (fsconfig(fs.get(), FSCONFIG_CMD_CREATE, nullptr, nullptr, 0) != 0) {
    return ErrnoStatus(errno, "creating the FUSE superblock for", target);
  }
  unsigned attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (o.read_only ? MOUNT_ATTR_RDONLY : 0) |
                   (o.noexec ? MOUNT_ATTR_NOEXEC : 0) | (o.noatime ? MOUNT_ATTR_NOATIME : 0);
  UniqueFd mnt(fsmount(fs.get(), FSMOUNT_CLOEXEC, attrs));
  if (!mnt) return ErrnoStatus(errno, "fsmount(fuse) for", target);
  if (move_mount(mnt.get(), "", target_fd, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) != 0) {
    return ErrnoStatus(errno, "move_mount of the FUSE mount onto", target);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<uint32_t>> FuseConnectionOfFd(int fd) {
  const std::string path = absl::StrCat("/proc/self/fdinfo/", fd);
  UniqueFd in(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) return ErrnoStatus(errno, "open", path);
  char buf[1024];
  ssize_t n = read(in.get(), buf, sizeof(buf) - 1);
  if (n < 0) return ErrnoStatus(errno, "read", path);
  buf[n] = '\0';
  constexpr char kKey[] = "\nfuse_connection:";
  const char* at = strstr(buf, kKey);
  if (at == nullptr) return std::optional<uint32_t>();
  char* end = nullptr;
  const unsigned long v = strtoul(at + sizeof(kKey) - 1, &end, 10);
  if (end == at + sizeof(kKey) - 1 || v > UINT32_MAX) {
    return absl::InternalError(absl::StrCat("unreadable fuse_connection line in ", path));
  }
  return std::optional<uint32_t>(static_cast<uint32_t>(v));
}

std::string FuseConnectionDir(uint32_t dev_minor) { return absl::StrCat(kFuseCtl, "/", dev_minor); }

absl::StatusOr<std::string> OpenFuseConnectionDirBlocking(uint32_t dev_minor) {
  struct stat st;
  const std::string dir = FuseConnectionDir(dev_minor);
  if (stat(dir.c_str(), &st) != 0) {
    // fusectl may simply not be mounted in this namespace.
    if (mount("fusectl", kFuseCtl, "fusectl", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0 &&
        errno != EBUSY) {
      return ErrnoStatus(errno, "mounting fusectl on", kFuseCtl);
    }
    if (stat(dir.c_str(), &st) != 0) {
      return absl::NotFoundError(absl::StrCat("FUSE connection ", dev_minor, " does not exist"));
    }
  }
  return dir;
}

absl::Status AbortFuseConnectionBlocking(uint32_t dev_minor) {
  auto dir = OpenFuseConnectionDirBlocking(dev_minor);
  if (!dir.ok()) return dir.status();
  const std::string abort_file = *dir + "/abort";
  UniqueFd fd(open(abort_file.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) return ErrnoStatus(errno, "open", abort_file);
  if (write(fd.get(), "1", 1) != 1) return ErrnoStatus(errno, "write", abort_file);
  return absl::OkStatus();
}

}  // namespace fusekeeper
