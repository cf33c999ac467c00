#define FUSE_USE_VERSION 35
#include "agent/fkserve/passthrough.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace fusekeeper {
namespace {

struct Inode {
  int fd = -1;          // O_PATH
  dev_t dev = 0;
  ino_t ino = 0;
  uint64_t nlookup = 0;  // kernel references
};

class Fs {
 public:
  explicit Fs(const PassthroughOptions& o) : options_(o) {}
  ~Fs() {
    for (auto& [key, inode] : inodes_) close(inode->fd);
    if (root_.fd >= 0) close(root_.fd);
  }

  absl::Status OpenRoot() {
    root_.fd = open(options_.root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root_.fd < 0) return absl::NotFoundError(absl::StrCat("cannot open export root ", options_.root, ": ", strerror(errno)));
    struct stat st;
    if (fstat(root_.fd, &st) != 0) return absl::InternalError("fstat root");
    root_.dev = st.st_dev;
    root_.ino = st.st_ino;
    root_.nlookup = 2;
    return absl::OkStatus();
  }

  Inode& Get(fuse_ino_t ino) {
    if (ino == FUSE_ROOT_ID) return root_;
    return *reinterpret_cast<Inode*>(ino);
  }
  fuse_ino_t Id(Inode& i) { return &i == &root_ ? FUSE_ROOT_ID : reinterpret_cast<fuse_ino_t>(&i); }

  // Presentation of attributes: the mount group, read-only.
  void Present(struct stat* st) const {
    if (options_.mount_group) {
      st->st_gid = *options_.mount_group;
      st->st_mode = (st->st_mode & ~static_cast<mode_t>(070)) | ((st->st_mode & 0700) >> 3);
    }
  }

  // Looks up `name` in `parent`, registering (or re-referencing) its inode.
  int Lookup(fuse_ino_t parent, const char* name, fuse_entry_param* e) {
    memset(e, 0, sizeof(*e));
    e->attr_timeout = 1.0;
    e->entry_timeout = 1.0;
    int fd = openat(Get(parent).fd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return errno;
    if (fstatat(fd, "", &e->attr, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
      int err = errno;
      close(fd);
      return err;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto key = std::make_pair(e->attr.st_dev, e->attr.st_ino);
    auto it = inodes_.find(key);
    Inode* inode;
    if (it != inodes_.end()) {
      inode = it->second.get();
      close(fd);
    } else if (key == std::make_pair(root_.dev, root_.ino)) {
      inode = &root_;
      close(fd);
    } else {
      auto fresh = std::make_unique<Inode>();
      fresh->fd = fd;
      fresh->dev = key.first;
      fresh->ino = key.second;
      inode = fresh.get();
      inodes_[key] = std::move(fresh);
    }
    inode->nlookup++;
    e->ino = Id(*inode);
    Present(&e->attr);
    return 0;
  }

  void Forget(fuse_ino_t ino, uint64_t n) {
    if (ino == FUSE_ROOT_ID) return;
    std::lock_guard<std::mutex> lock(mu_);
    Inode& i = Get(ino);
    i.nlookup -= std::min(n, i.nlookup);
    if (i.nlookup == 0) {
      close(i.fd);
      inodes_.erase(std::make_pair(i.dev, i.ino));
    }
  }

  std::string ProcPath(fuse_ino_t ino) { return absl::StrCat("/proc/self/fd/", Get(ino).fd); }
  bool read_only() const { return options_.read_only; }

 private:
  const PassthroughOptions options_;
  Inode root_;
  std::mutex mu_;
  std::map<std::pair<dev_t, ino_t>, std::unique_ptr<Inode>> inodes_;
};

Fs* F(fuse_req_t req) { return static_cast<Fs*>(fuse_req_userdata(req)); }

void ReplyEntryOrErr(fuse_req_t req, fuse_ino_t parent, const char* name) {
  fuse_entry_param e;
  int err = F(req)->Lookup(parent, name, &e);
  if (err) {
    fuse_reply_err(req, err);
  } else {
    fuse_reply_entry(req, &e);
  }
}

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) { ReplyEntryOrErr(req, parent, name); }

void OpForget(fuse_req_t req, fuse_ino_t ino, uint64_t n) {
  F(req)->Forget(ino, n);
  fuse_reply_none(req);
}

void OpForgetMulti(fuse_req_t req, size_t count, fuse_forget_data* forgets) {
  for (size_t i = 0; i < count; ++i) F(req)->Forget(forgets[i].ino, forgets[i].nlookup);
  fuse_reply_none(req);
}

void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  struct stat st;
  if (fstatat(F(req)->Get(ino).fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
    return (void)fuse_reply_err(req, errno);
  }
  F(req)->Present(&st);
  fuse_reply_attr(req, &st, 1.0);
}

void OpSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set, fuse_file_info* fi) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  const std::string path = F(req)->ProcPath(ino);
  if (to_set & FUSE_SET_ATTR_MODE) {
    if (chmod(path.c_str(), attr->st_mode) != 0) return (void)fuse_reply_err(req, errno);
  }
  if (to_set & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID)) {
    uid_t u = (to_set & FUSE_SET_ATTR_UID) ? attr->st_uid : static_cast<uid_t>(-1);
    gid_t g = (to_set & FUSE_SET_ATTR_GID) ? attr->st_gid : static_cast<gid_t>(-1);
    if (fchownat(F(req)->Get(ino).fd, "", u, g, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
      return (void)fuse_reply_err(req, errno);
    }
  }
  if (to_set & FUSE_SET_ATTR_SIZE) {
    int r = fi ? ftruncate(static_cast<int>(fi->fh), attr->st_size) : truncate(path.c_str(), attr->st_size);
    if (r != 0) return (void)fuse_reply_err(req, errno);
  }
  if (to_set & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME)) {
    timespec tv[2] = {{0, UTIME_OMIT}, {0, UTIME_OMIT}};
    if (to_set & FUSE_SET_ATTR_ATIME_NOW) tv[0].tv_nsec = UTIME_NOW;
    else if (to_set & FUSE_SET_ATTR_ATIME) tv[0] = attr->st_atim;
    if (to_set & FUSE_SET_ATTR_MTIME_NOW) tv[1].tv_nsec = UTIME_NOW;
    else if (to_set & FUSE_SET_ATTR_MTIME) tv[1] = attr->st_mtim;
    if (utimensat(AT_FDCWD, path.c_str(), tv, 0) != 0) return (void)fuse_reply_err(req, errno);
  }
  OpGetattr(req, ino, fi);
}

void OpReadlink(fuse_req_t req, fuse_ino_t ino) {
  char buf[PATH_MAX + 1];
  ssize_t n = readlinkat(F(req)->Get(ino).fd, "", buf, PATH_MAX);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  buf[n] = '\0';
  fuse_reply_readlink(req, buf);
}

void OpMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  if (mkdirat(F(req)->Get(parent).fd, name, mode) != 0) return (void)fuse_reply_err(req, errno);
  ReplyEntryOrErr(req, parent, name);
}

void OpSymlink(fuse_req_t req, const char* link, fuse_ino_t parent, const char* name) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  if (symlinkat(link, F(req)->Get(parent).fd, name) != 0) return (void)fuse_reply_err(req, errno);
  ReplyEntryOrErr(req, parent, name);
}

void OpUnlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  fuse_reply_err(req, unlinkat(F(req)->Get(parent).fd, name, 0) == 0 ? 0 : errno);
}

void OpRmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  fuse_reply_err(req, unlinkat(F(req)->Get(parent).fd, name, AT_REMOVEDIR) == 0 ? 0 : errno);
}

void OpRename(fuse_req_t req, fuse_ino_t parent, const char* name, fuse_ino_t newparent,
              const char* newname, unsigned int flags) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  if (flags != 0) return (void)fuse_reply_err(req, EINVAL);
  fuse_reply_err(req, renameat(F(req)->Get(parent).fd, name, F(req)->Get(newparent).fd, newname) == 0 ? 0 : errno);
}

void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (F(req)->read_only() && (fi->flags & O_ACCMODE) != O_RDONLY) return (void)fuse_reply_err(req, EROFS);
  int fd = open(F(req)->ProcPath(ino).c_str(), (fi->flags & ~O_NOFOLLOW) | O_CLOEXEC);
  if (fd < 0) return (void)fuse_reply_err(req, errno);
  fi->fh = static_cast<uint64_t>(fd);
  fuse_reply_open(req, fi);
}

void OpCreate(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, fuse_file_info* fi) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  int fd = openat(F(req)->Get(parent).fd, name, (fi->flags | O_CREAT | O_NOFOLLOW) | O_CLOEXEC, mode);
  if (fd < 0) return (void)fuse_reply_err(req, errno);
  fi->fh = static_cast<uint64_t>(fd);
  fuse_entry_param e;
  int err = F(req)->Lookup(parent, name, &e);
  if (err) {
    close(fd);
    return (void)fuse_reply_err(req, err);
  }
  fuse_reply_create(req, &e, fi);
}

void OpRead(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  std::string buf(size, '\0');
  ssize_t n = pread(static_cast<int>(fi->fh), buf.data(), size, off);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  fuse_reply_buf(req, buf.data(), static_cast<size_t>(n));
}

void OpWrite(fuse_req_t req, fuse_ino_t, const char* data, size_t size, off_t off, fuse_file_info* fi) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  ssize_t n = pwrite(static_cast<int>(fi->fh), data, size, off);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  fuse_reply_write(req, static_cast<size_t>(n));
}

void OpFlush(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  int dup_fd = dup(static_cast<int>(fi->fh));
  fuse_reply_err(req, dup_fd >= 0 && close(dup_fd) == 0 ? 0 : errno);
}

void OpRelease(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  close(static_cast<int>(fi->fh));
  fuse_reply_err(req, 0);
}

void OpFsync(fuse_req_t req, fuse_ino_t, int datasync, fuse_file_info* fi) {
  int fd = static_cast<int>(fi->fh);
  fuse_reply_err(req, (datasync ? fdatasync(fd) : fsync(fd)) == 0 ? 0 : errno);
}

void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  int fd = openat(F(req)->Get(ino).fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return (void)fuse_reply_err(req, errno);
  DIR* d = fdopendir(fd);
  if (d == nullptr) {
    int err = errno;
    close(fd);
    return (void)fuse_reply_err(req, err);
  }
  fi->fh = reinterpret_cast<uint64_t>(d);
  fuse_reply_open(req, fi);
}

void OpReaddir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  DIR* d = reinterpret_cast<DIR*>(fi->fh);
  std::string buf(size, '\0');
  size_t used = 0;
  seekdir(d, off);
  while (true) {
    errno = 0;
    dirent* e = readdir(d);
    if (e == nullptr) {
      if (errno) return (void)fuse_reply_err(req, errno);
      break;
    }
    struct stat st{};
    st.st_ino = e->d_ino;
    st.st_mode = static_cast<mode_t>(e->d_type) << 12;
    size_t need = fuse_add_direntry(req, buf.data() + used, size - used, e->d_name, &st, telldir(d));
    if (need > size - used) break;
    used += need;
  }
  fuse_reply_buf(req, buf.data(), used);
}

void OpReleasedir(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  closedir(reinterpret_cast<DIR*>(fi->fh));
  fuse_reply_err(req, 0);
}

void OpStatfs(fuse_req_t req, fuse_ino_t ino) {
  struct statvfs sv;
  if (fstatvfs(F(req)->Get(ino).fd, &sv) != 0) return (void)fuse_reply_err(req, errno);
  fuse_reply_statfs(req, &sv);
}

void OpSetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, const char* value, size_t size, int flags) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  fuse_reply_err(req, setxattr(F(req)->ProcPath(ino).c_str(), name, value, size, flags) == 0 ? 0 : errno);
}

void OpGetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
  std::string buf(size, '\0');
  ssize_t n = getxattr(F(req)->ProcPath(ino).c_str(), name, size ? buf.data() : nullptr, size);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  if (size == 0) return (void)fuse_reply_xattr(req, static_cast<size_t>(n));
  fuse_reply_buf(req, buf.data(), static_cast<size_t>(n));
}

void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  std::string buf(size, '\0');
  ssize_t n = listxattr(F(req)->ProcPath(ino).c_str(), size ? buf.data() : nullptr, size);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  if (size == 0) return (void)fuse_reply_xattr(req, static_cast<size_t>(n));
  fuse_reply_buf(req, buf.data(), static_cast<size_t>(n));
}

void OpRemovexattr(fuse_req_t req, fuse_ino_t ino, const char* name) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  fuse_reply_err(req, removexattr(F(req)->ProcPath(ino).c_str(), name) == 0 ? 0 : errno);
}

fuse_lowlevel_ops MakeOps() {
  fuse_lowlevel_ops o{};
  o.lookup = OpLookup;
  o.forget = OpForget;
  o.forget_multi = OpForgetMulti;
  o.getattr = OpGetattr;
  o.setattr = OpSetattr;
  o.readlink = OpReadlink;
  o.mkdir = OpMkdir;
  o.symlink = OpSymlink;
  o.unlink = OpUnlink;
  o.rmdir = OpRmdir;
  o.rename = OpRename;
  o.open = OpOpen;
  o.create = OpCreate;
  o.read = OpRead;
  o.write = OpWrite;
  o.flush = OpFlush;
  o.release = OpRelease;
  o.fsync = OpFsync;
  o.opendir = OpOpendir;
  o.readdir = OpReaddir;
  o.releasedir = OpReleasedir;
  o.statfs = OpStatfs;
  o.setxattr = OpSetxattr;
  o.getxattr = OpGetxattr;
  o.listxattr = OpListxattr;
  o.removexattr = OpRemovexattr;
  return o;
}

}  // namespace

absl::Status ServePassthrough(int fuse_fd, const PassthroughOptions& options) {
  Fs fs(options);
  if (auto s = fs.OpenRoot(); !s.ok()) {
    close(fuse_fd);
    return s;
  }
  static const fuse_lowlevel_ops ops = MakeOps();
  char arg0[] = "fkserve";
  char* argv[] = {arg0, nullptr};
  fuse_args args = FUSE_ARGS_INIT(1, argv);
  fuse_session* se = fuse_session_new(&args, &ops, sizeof(ops), &fs);
  fuse_opt_free_args(&args);
  if (se == nullptr) {
    close(fuse_fd);
    return absl::InternalError("fuse_session_new failed");
  }
  // libfuse 3.3+: "/dev/fd/N" means "already mounted; serve this fd".
  if (fuse_session_mount(se, absl::StrCat("/dev/fd/", fuse_fd).c_str()) != 0) {
    fuse_session_destroy(se);
    return absl::InternalError("fuse_session_mount(/dev/fd/N) failed");
  }
  int r = fuse_session_loop(se);
  fuse_session_destroy(se);
  // The loop ends with 0 on a clean unmount; ENODEV (connection gone) is also a normal end.
  if (r != 0 && r != -ENODEV && r != ENODEV) {
    return absl::InternalError(absl::StrCat("FUSE session ended with error ", r));
  }
  return absl::OkStatus();
}

}  // namespace fusekeeper
