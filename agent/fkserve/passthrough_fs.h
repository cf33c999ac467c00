// The reference server's file system (passthrough.h): its inodes and the Fs that holds them.
// Private to passthrough.cc (a header only to keep that file to its FUSE operations and session).
#pragma once

#define FUSE_USE_VERSION 35
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "agent/fkserve/relay/fuse_wire.h"
#include "absl/strings/str_cat.h"
#include "agent/fkserve/passthrough.h"

namespace fusekeeper::passthrough_internal {


struct Inode {
  int fd = -1;          // O_PATH
  dev_t dev = 0;
  ino_t ino = 0;
  uint64_t nlookup = 0;  // kernel references
};

// Node ids are stable across server restarts: st_ino + 2 for inodes on the export root's file
// system (0 and 1 are reserved by FUSE), so a server adopting a live connection can resolve the
// node ids its dead predecessor handed out (by walking the export, see Resolve). Inodes on other
// file systems (mounts inside the export) get ids from a counter and are not resumable.
constexpr uint64_t kForeignBase = 1ULL << 62;

class Fs {
 public:
  explicit Fs(const PassthroughOptions& o) : options_(o), handle_generation_(RandomGeneration()) {}
  ~Fs() {
    for (auto& [id, inode] : inodes_) close(inode->fd);
    for (auto& [fh, fd] : files_) close(fd);
    for (auto& [fh, d] : dirs_) closedir(d);
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

  // The inode for a node id, or null (ESTALE) if it cannot be found any more.
  Inode* Get(fuse_ino_t ino) {
    if (ino == FUSE_ROOT_ID) return &root_;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = inodes_.find(ino);
    if (it != inodes_.end()) return it->second.get();
    return Resolve(ino);
  }

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
    Inode* p = Get(parent);
    if (p == nullptr) return ESTALE;
    int fd = openat(p->fd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return errno;
    if (fstatat(fd, "", &e->attr, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
      int err = errno;
      close(fd);
      return err;
    }
    if (e->attr.st_dev == root_.dev && e->attr.st_ino == root_.ino) {
      close(fd);
      e->ino = FUSE_ROOT_ID;
      Present(&e->attr);
      return 0;
    }
    std::lock_guard<std::mutex> lock(mu_);
    fuse_ino_t id = 0;
    if (e->attr.st_dev == root_.dev) {
      id = static_cast<fuse_ino_t>(e->attr.st_ino) + 2;
    } else {
      auto f = foreign_.find({e->attr.st_dev, e->attr.st_ino});
      id = f != foreign_.end() ? f->second : kForeignBase + next_foreign_++;
      foreign_[{e->attr.st_dev, e->attr.st_ino}] = id;
    }
    Inode* inode = Register(id, fd, e->attr.st_dev, e->attr.st_ino);
    inode->nlookup++;
    e->ino = id;
    Present(&e->attr);
    return 0;
  }

  void Forget(fuse_ino_t ino, uint64_t n) {
    if (ino == FUSE_ROOT_ID) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = inodes_.find(ino);
    if (it == inodes_.end()) return;
    Inode& i = *it->second;
    i.nlookup -= std::min(n, i.nlookup);
    if (i.nlookup == 0) {
      close(i.fd);
      if (ino >= kForeignBase) foreign_.erase({i.dev, i.ino});
      inodes_.erase(it);
    }
  }

  bool read_only() const { return options_.read_only; }
  bool xattrs() const { return options_.xattrs; }
  void* io() const { return io_; }
  void set_io(void* io) { io_ = io; }

  // File handles: generation-tagged, so a handle a dead predecessor issued is never mistaken for
  // one of ours; such a handle is re-opened (by its node id) the first time it is used.
  uint64_t AddFile(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t fh = handle_generation_ << 32 | next_handle_++;
    files_[fh] = fd;
    return fh;
  }
  int File(fuse_ino_t ino, uint64_t fh) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = files_.find(fh);
      if (it != files_.end()) return it->second;
      if ((fh >> 32) == handle_generation_) return -1;  // ours, and released
    }
    Inode* inode = Get(ino);
    if (inode == nullptr) return -1;
    const std::string path = absl::StrCat("/proc/self/fd/", inode->fd);
    int fd = open(path.c_str(), (options_.read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC);
    if (fd < 0) fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    std::lock_guard<std::mutex> lock(mu_);
    files_[fh] = fd;
    return fd;
  }
  void ReleaseFile(uint64_t fh) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(fh);
    if (it == files_.end()) return;
    close(it->second);
    files_.erase(it);
  }
  uint64_t AddDir(DIR* d) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t fh = handle_generation_ << 32 | next_handle_++;
    dirs_[fh] = d;
    return fh;
  }
  DIR* Dir(fuse_ino_t ino, uint64_t fh) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = dirs_.find(fh);
      if (it != dirs_.end()) return it->second;
      if ((fh >> 32) == handle_generation_) return nullptr;
    }
    Inode* inode = Get(ino);
    if (inode == nullptr) return nullptr;
    int fd = openat(inode->fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return nullptr;
    DIR* d = fdopendir(fd);
    if (d == nullptr) {
      close(fd);
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    dirs_[fh] = d;
    return d;
  }
  void ReleaseDir(uint64_t fh) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = dirs_.find(fh);
    if (it == dirs_.end()) return;
    closedir(it->second);
    dirs_.erase(it);
  }

 private:
  static uint64_t RandomGeneration() {
    uint32_t g = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      (void)!read(fd, &g, sizeof(g));
      close(fd);
    }
    return g == 0 ? static_cast<uint64_t>(getpid()) : g;
  }

  // mu_ held.
  Inode* Register(fuse_ino_t id, int fd, dev_t dev, ino_t ino) {
    auto it = inodes_.find(id);
    if (it != inodes_.end()) {
      close(fd);
      return it->second.get();
    }
    auto fresh = std::make_unique<Inode>();
    fresh->fd = fd;
    fresh->dev = dev;
    fresh->ino = ino;
    Inode* raw = fresh.get();
    inodes_[id] = std::move(fresh);
    return raw;
  }

  // mu_ held. A node id we did not issue (a predecessor did): find the inode by walking the
  // export root's file system, breadth first, up to a bound.
  Inode* Resolve(fuse_ino_t id) {
    if (id < 2 || id >= kForeignBase) return nullptr;
    const ino_t want = static_cast<ino_t>(id - 2);
    std::vector<int> queue;
    int first = openat(root_.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (first < 0) return nullptr;
    queue.push_back(first);
    Inode* found = nullptr;
    size_t seen = 0;
    for (size_t qi = 0; qi < queue.size(); ++qi) {
      int dfd = queue[qi];
      DIR* d = found == nullptr && seen < kResolveLimit ? fdopendir(dup(dfd)) : nullptr;
      close(dfd);
      if (d == nullptr) continue;
      while (dirent* e = readdir(d)) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (++seen > kResolveLimit) break;
        if (e->d_ino == want) {
          int fd = openat(dirfd(d), e->d_name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
          struct stat st;
          if (fd >= 0 && fstat(fd, &st) == 0 && st.st_dev == root_.dev && st.st_ino == want) {
            found = Register(id, fd, st.st_dev, st.st_ino);
            found->nlookup = 1;
            break;
          }
          if (fd >= 0) close(fd);
        }
        if (e->d_type == DT_DIR) {
          int sub = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
          struct stat st;
          if (sub >= 0 && fstat(sub, &st) == 0 && st.st_dev == root_.dev) {
            queue.push_back(sub);
          } else if (sub >= 0) {
            close(sub);
          }
        }
      }
      closedir(d);
    }
    return found;
  }

  static constexpr size_t kResolveLimit = 200000;
  const PassthroughOptions options_;
  const uint64_t handle_generation_;
  Inode root_;
  std::mutex mu_;
  std::map<fuse_ino_t, std::unique_ptr<Inode>> inodes_;
  std::map<std::pair<dev_t, ino_t>, fuse_ino_t> foreign_;
  uint64_t next_foreign_ = 0;
  uint32_t next_handle_ = 1;
  std::map<uint64_t, int> files_;
  std::map<uint64_t, DIR*> dirs_;
  void* io_ = nullptr;
};

}  // namespace fusekeeper::passthrough_internal
