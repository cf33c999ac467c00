#define FUSE_USE_VERSION 35
#include "agent/fkserve/passthrough.h"


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
#include <optional>

#include "agent/fkserve/backing_client.h"
#include "agent/fkserve/backing_table.h"
#include "agent/fkserve/passthrough_fs.h"
#include "agent/fkserve/passthrough_init.h"
#include "agent/fuse/passthrough_abi.h"
#include "agent/fkserve/relay/fuse_wire.h"
#include "absl/strings/str_cat.h"

namespace fusekeeper {
namespace {

using namespace passthrough_internal;  // NOLINT: the file system this file serves

Fs* F(fuse_req_t req) { return static_cast<Fs*>(fuse_req_userdata(req)); }

// Passthrough (below, with the session's I/O): an OPEN's or CREATE's backing id from the agent,
// and its release.
void MaybePassthrough(fuse_req_t req, fuse_ino_t ino, int fd, fuse_file_info* fi);
void ReleaseBacking(fuse_req_t req, uint64_t fh);

// The inode behind a node id, or an ESTALE reply (a node id no server can resolve any more).
#define INODE_OR_ESTALE(var, req, ino)          \
  Inode* var = F(req)->Get(ino);                \
  if (var == nullptr) return (void)fuse_reply_err(req, ESTALE)

std::string ProcPath(const Inode* i) { return absl::StrCat("/proc/self/fd/", i->fd); }

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
  INODE_OR_ESTALE(inode, req, ino);
  struct stat st;
  if (fstatat(inode->fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
    return (void)fuse_reply_err(req, errno);
  }
  F(req)->Present(&st);
  fuse_reply_attr(req, &st, 1.0);
}

void OpSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set, fuse_file_info* fi) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  INODE_OR_ESTALE(inode, req, ino);
  const std::string path = ProcPath(inode);
  if (to_set & FUSE_SET_ATTR_MODE) {
    if (chmod(path.c_str(), attr->st_mode) != 0) return (void)fuse_reply_err(req, errno);
  }
  if (to_set & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID)) {
    uid_t u = (to_set & FUSE_SET_ATTR_UID) ? attr->st_uid : static_cast<uid_t>(-1);
    gid_t g = (to_set & FUSE_SET_ATTR_GID) ? attr->st_gid : static_cast<gid_t>(-1);
    if (fchownat(inode->fd, "", u, g, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
      return (void)fuse_reply_err(req, errno);
    }
  }
  if (to_set & FUSE_SET_ATTR_SIZE) {
    int r = fi ? ftruncate(F(req)->File(ino, fi->fh), attr->st_size) : truncate(path.c_str(), attr->st_size);
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
  INODE_OR_ESTALE(inode, req, ino);
  char buf[PATH_MAX + 1];
  ssize_t n = readlinkat(inode->fd, "", buf, PATH_MAX);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  buf[n] = '\0';
  fuse_reply_readlink(req, buf);
}

void OpMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  INODE_OR_ESTALE(p, req, parent);
  if (mkdirat(p->fd, name, mode) != 0) return (void)fuse_reply_err(req, errno);
  ReplyEntryOrErr(req, parent, name);
}

void OpSymlink(fuse_req_t req, const char* link, fuse_ino_t parent, const char* name) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  INODE_OR_ESTALE(p, req, parent);
  if (symlinkat(link, p->fd, name) != 0) return (void)fuse_reply_err(req, errno);
  ReplyEntryOrErr(req, parent, name);
}

void OpUnlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  INODE_OR_ESTALE(p, req, parent);
  fuse_reply_err(req, unlinkat(p->fd, name, 0) == 0 ? 0 : errno);
}

void OpRmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  INODE_OR_ESTALE(p, req, parent);
  fuse_reply_err(req, unlinkat(p->fd, name, AT_REMOVEDIR) == 0 ? 0 : errno);
}

void OpRename(fuse_req_t req, fuse_ino_t parent, const char* name, fuse_ino_t newparent,
              const char* newname, unsigned int flags) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  if (flags != 0) return (void)fuse_reply_err(req, EINVAL);
  INODE_OR_ESTALE(p, req, parent);
  INODE_OR_ESTALE(np, req, newparent);
  fuse_reply_err(req, renameat(p->fd, name, np->fd, newname) == 0 ? 0 : errno);
}

void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (F(req)->read_only() && (fi->flags & O_ACCMODE) != O_RDONLY) return (void)fuse_reply_err(req, EROFS);
  INODE_OR_ESTALE(inode, req, ino);
  int fd = open(ProcPath(inode).c_str(), (fi->flags & ~O_NOFOLLOW) | O_CLOEXEC);
  if (fd < 0) return (void)fuse_reply_err(req, errno);
  fi->fh = F(req)->AddFile(fd);
  MaybePassthrough(req, ino, fd, fi);
  fuse_reply_open(req, fi);
}

void OpCreate(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, fuse_file_info* fi) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  INODE_OR_ESTALE(p, req, parent);
  int fd = openat(p->fd, name, (fi->flags | O_CREAT | O_NOFOLLOW) | O_CLOEXEC, mode);
  if (fd < 0) return (void)fuse_reply_err(req, errno);
  fuse_entry_param e;
  int err = F(req)->Lookup(parent, name, &e);
  if (err) {
    close(fd);
    return (void)fuse_reply_err(req, err);
  }
  fi->fh = F(req)->AddFile(fd);
  MaybePassthrough(req, e.ino, fd, fi);
  fuse_reply_create(req, &e, fi);
}

void OpRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  const int fd = F(req)->File(ino, fi->fh);
  if (fd < 0) return (void)fuse_reply_err(req, EBADF);
  std::string buf(size, '\0');
  ssize_t n = pread(fd, buf.data(), size, off);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  fuse_reply_buf(req, buf.data(), static_cast<size_t>(n));
}

void OpWrite(fuse_req_t req, fuse_ino_t ino, const char* data, size_t size, off_t off, fuse_file_info* fi) {
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  const int fd = F(req)->File(ino, fi->fh);
  if (fd < 0) return (void)fuse_reply_err(req, EBADF);
  ssize_t n = pwrite(fd, data, size, off);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  fuse_reply_write(req, static_cast<size_t>(n));
}

void OpFlush(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  const int fd = F(req)->File(ino, fi->fh);
  if (fd < 0) return (void)fuse_reply_err(req, 0);  // nothing of ours to flush
  int dup_fd = dup(fd);
  fuse_reply_err(req, dup_fd >= 0 && close(dup_fd) == 0 ? 0 : errno);
}

void OpRelease(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  ReleaseBacking(req, fi->fh);
  F(req)->ReleaseFile(fi->fh);
  fuse_reply_err(req, 0);
}

void OpFsync(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info* fi) {
  const int fd = F(req)->File(ino, fi->fh);
  if (fd < 0) return (void)fuse_reply_err(req, EBADF);
  fuse_reply_err(req, (datasync ? fdatasync(fd) : fsync(fd)) == 0 ? 0 : errno);
}

void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  INODE_OR_ESTALE(inode, req, ino);
  int fd = openat(inode->fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return (void)fuse_reply_err(req, errno);
  DIR* d = fdopendir(fd);
  if (d == nullptr) {
    int err = errno;
    close(fd);
    return (void)fuse_reply_err(req, err);
  }
  fi->fh = F(req)->AddDir(d);
  fuse_reply_open(req, fi);
}

void OpReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  DIR* d = F(req)->Dir(ino, fi->fh);
  if (d == nullptr) return (void)fuse_reply_err(req, EBADF);
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
  F(req)->ReleaseDir(fi->fh);
  fuse_reply_err(req, 0);
}

void OpStatfs(fuse_req_t req, fuse_ino_t ino) {
  INODE_OR_ESTALE(inode, req, ino);
  struct statvfs sv;
  if (fstatvfs(inode->fd, &sv) != 0) return (void)fuse_reply_err(req, errno);
  fuse_reply_statfs(req, &sv);
}

void OpSetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, const char* value, size_t size, int flags) {
  if (!F(req)->xattrs()) return (void)fuse_reply_err(req, ENOSYS);
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  INODE_OR_ESTALE(inode, req, ino);
  fuse_reply_err(req, setxattr(ProcPath(inode).c_str(), name, value, size, flags) == 0 ? 0 : errno);
}

void OpGetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
  if (!F(req)->xattrs()) return (void)fuse_reply_err(req, ENOSYS);
  INODE_OR_ESTALE(inode, req, ino);
  std::string buf(size, '\0');
  ssize_t n = getxattr(ProcPath(inode).c_str(), name, size ? buf.data() : nullptr, size);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  if (size == 0) return (void)fuse_reply_xattr(req, static_cast<size_t>(n));
  fuse_reply_buf(req, buf.data(), static_cast<size_t>(n));
}

void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  if (!F(req)->xattrs()) return (void)fuse_reply_err(req, ENOSYS);
  INODE_OR_ESTALE(inode, req, ino);
  std::string buf(size, '\0');
  ssize_t n = listxattr(ProcPath(inode).c_str(), size ? buf.data() : nullptr, size);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  if (size == 0) return (void)fuse_reply_xattr(req, static_cast<size_t>(n));
  fuse_reply_buf(req, buf.data(), static_cast<size_t>(n));
}

void OpRemovexattr(fuse_req_t req, fuse_ino_t ino, const char* name) {
  if (!F(req)->xattrs()) return (void)fuse_reply_err(req, ENOSYS);
  if (F(req)->read_only()) return (void)fuse_reply_err(req, EROFS);
  INODE_OR_ESTALE(inode, req, ino);
  fuse_reply_err(req, removexattr(ProcPath(inode).c_str(), name) == 0 ? 0 : errno);
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

// libfuse custom I/O: replays the recorded FUSE_INIT first; on a live connection drops libfuse's
// answer to it (the kernel had its answer from the first server) and asks for a resend.
struct ReplayIo {
  std::string init;
  bool live = false;
  bool replayed = false;
  bool answered = false;
  uint64_t init_unique = 0;
  int stop_fd = -1;  // PassthroughOptions::stop_fd
  fuse_session* se = nullptr;
  // Passthrough (PassthroughOptions::backing). The session is one thread: an OPEN's handler and
  // the write of its reply follow each other, so the backing id waits here for that reply.
  BackingClient* backing = nullptr;
  bool kernel_offers_passthrough = false;
  // FUSE_HANDLE_KILLPRIV_V2 said in our INIT reply (KillPrivIsTheExports).
  bool killpriv = false;
  bool passthrough = false;  // offered in our INIT reply (or, adopted, taken on trust: the agent checks)
  struct Pending {
    uint64_t fh = 0;
    int32_t backing_id = 0;
  };
  std::optional<Pending> pending;
  // The kernel takes one backing file per inode: every passthrough open of an inode must name the
  // same one (another: EBUSY; a cached open beside them: EIO). So an inode's first open registers
  // it, the others share it, and the last release closes it, whichever server opened it
  // (backing_table.h).
  BackingTable* table = nullptr;
  bool register_backing = true;  // PassthroughOptions::register_backing
  bool said_refused = false;
};

ReplayIo* Io(fuse_req_t req);

void ReleaseBacking(fuse_req_t req, uint64_t fh) {
  ReplayIo* io = Io(req);
  if (io == nullptr || io->table == nullptr) return;
  // The kernel's open files keep their own reference to the backing file.
  if (const int32_t id = io->table->Remove(fh)) io->backing->Close(id);
}

// An OPEN or CREATE of inode `ino` as `fd` (handle fi->fh): its backing id, kept for the reply.
void MaybePassthrough(fuse_req_t req, fuse_ino_t ino, int fd, fuse_file_info* fi) {
  ReplayIo* io = Io(req);
  if (io == nullptr || !io->passthrough || io->backing == nullptr || io->table == nullptr) return;
  const uint64_t fh = fi->fh;
  if (const int32_t shared = io->table->IdOf(ino)) {
    // A full table: the kernel allows direct I/O beside the inode's passthrough files (a cached
    // open would fail).
    if (!io->table->Add(fh, ino, shared)) return (void)(fi->direct_io = 1);
    io->pending = ReplayIo::Pending{fh, shared};
    return;
  }
  // Served the ordinary way, and recorded so (a full table: direct I/O, allowed beside both).
  auto ordinary = [&] {
    if (!io->table->Add(fh, ino, BackingTable::kCached)) fi->direct_io = 1;
  };
  // Beside a file of it open the ordinary way, an open must be that way too (the kernel refuses
  // passthrough beside a cached open: EIO); and none is registered with passthrough turned off.
  if (io->table->HasCachedOpens(ino) || !io->register_backing) return ordinary();
  auto id = io->backing->Open(fd);
  if (!id.ok()) {
    ordinary();
    if (!io->said_refused) {
      io->said_refused = true;
      fprintf(stderr, "fkserve: passthrough: the agent did not register a file (%s); such opens are served the "
              "ordinary way\n", std::string(id.status().message()).c_str());
    }
    return;
  }
  if (!io->table->Add(fh, ino, *id)) {  // full
    io->backing->Close(*id);
    fi->direct_io = 1;
    return;
  }
  io->pending = ReplayIo::Pending{fh, *id};
}

std::string Gather(const iovec* iov, int count) {
  std::string msg;
  for (int i = 0; i < count; ++i) msg.append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
  return msg;
}

ReplayIo* Io(fuse_req_t req) { return static_cast<ReplayIo*>(F(req)->io()); }

ssize_t IoRead(int fd, void* buf, size_t len, void* userdata) {
  auto* io = static_cast<ReplayIo*>(static_cast<Fs*>(userdata)->io());
  if (!io->replayed && !io->init.empty()) {
    io->replayed = true;
    if (io->init.size() > len) {
      errno = EINVAL;
      return -1;
    }
    memcpy(buf, io->init.data(), io->init.size());
    return static_cast<ssize_t>(io->init.size());
  }
  while (true) {
    // With a stop fd the connection is non-blocking: a busy server reads without a poll first.
    const ssize_t n = read(fd, buf, len);
    // An aborted connection answers reads ECONNABORTED: ended, as libfuse takes ENODEV.
    if (n < 0 && errno == ECONNABORTED) errno = ENODEV;
    if (n >= 0 || errno != EAGAIN || io->stop_fd < 0) return n;
    pollfd p[2] = {{fd, POLLIN, 0}, {io->stop_fd, POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno != EINTR) return -1;
    if (p[1].revents != 0) {
      fuse_session_exit(io->se);  // libfuse ends its loop once the read returns
      errno = EINTR;
      return -1;
    }
  }
}

ssize_t IoWritev(int fd, iovec* iov, int count, void* userdata) {
  auto* io = static_cast<ReplayIo*>(static_cast<Fs*>(userdata)->io());
  if (count == 0 || iov[0].iov_len < sizeof(fuse_out_header)) return writev(fd, iov, count);
  const auto* h = static_cast<const fuse_out_header*>(iov[0].iov_base);
  std::string msg;  // a reply completed here, written whole
  if (!io->answered && h->unique == io->init_unique) {
    io->answered = true;
    if (io->live) {
      // Adopted: the kernel had its answer from the first server; the requests that server read
      // and did not answer are asked for again instead.
      size_t total = 0;
      for (int i = 0; i < count; ++i) total += iov[i].iov_len;
      if (const int err = relay::AskKernelToResend(fd); err != 0) {
        fprintf(stderr, "fkserve: the kernel cannot resend requests (%s); requests the previous "
                "server had read stay unanswered\n", strerror(err));
      }
      return static_cast<ssize_t>(total);
    }
    if (io->kernel_offers_passthrough && io->backing != nullptr && h->error == 0) {
      msg = Gather(iov, count);
      io->passthrough = OfferPassthroughInReply(&msg);
      fprintf(stderr, "fkserve: passthrough: %s\n",
              io->passthrough ? "asked for in the INIT reply (the agent registers each opened file)"
                              : "not asked for (writeback caching is on)");
      if (!io->passthrough) msg.clear();
    }
    if (io->killpriv && h->error == 0) {
      if (msg.empty()) msg = Gather(iov, count);
      if (!HandleKillPrivInReply(&msg)) msg.clear();
    }
  } else if (io->pending) {
    // The session is one thread: the reply after an OPEN's or CREATE's handler is that one's.
    if (h->error == 0) {
      msg = Gather(iov, count);
      if (!PassThroughInOpenReply(&msg, io->pending->fh, io->pending->backing_id)) msg.clear();
    }
    io->pending.reset();
  }
  if (!msg.empty()) return write(fd, msg.data(), msg.size());
  return writev(fd, iov, count);
}

}  // namespace

absl::StatusOr<std::string> ReadInitRequest(int fuse_fd, int timeout_ms) {
  pollfd p{fuse_fd, POLLIN, 0};
  int r = poll(&p, 1, timeout_ms);
  if (r == 0) return absl::DeadlineExceededError("no FUSE_INIT arrived on the connection");
  if (r < 0) return absl::InternalError(absl::StrCat("poll /dev/fuse: ", strerror(errno)));
  // /dev/fuse refuses reads into buffers smaller than FUSE_MIN_READ_BUFFER (8 KiB).
  std::string buf(64 * 1024, '\0');
  ssize_t n = read(fuse_fd, buf.data(), buf.size());
  if (n < 0) {
    return absl::UnavailableError(absl::StrCat("reading FUSE_INIT: ", strerror(errno),
                                               errno == ENODEV ? " (the connection was aborted)" : ""));
  }
  if (static_cast<size_t>(n) < sizeof(fuse_in_header)) return absl::InternalError("short read from /dev/fuse");
  fuse_in_header h;
  memcpy(&h, buf.data(), sizeof(h));
  if (h.opcode != FUSE_INIT) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the connection's first request is opcode ", h.opcode, ", not FUSE_INIT: it was served before"));
  }
  buf.resize(static_cast<size_t>(n));
  return buf;
}

absl::Status ServePassthrough(int fuse_fd, const PassthroughOptions& options) {
  Fs fs(options);
  if (auto s = fs.OpenRoot(); !s.ok()) {
    close(fuse_fd);
    return s;
  }
  ReplayIo io;
  io.init = options.init_request;
  io.live = options.live;
  if (io.init.size() >= sizeof(fuse_in_header)) {
    fuse_in_header h;
    memcpy(&h, io.init.data(), sizeof(h));
    io.init_unique = h.unique;
  } else if (options.live) {
    close(fuse_fd);
    return absl::FailedPreconditionError("a live connection needs its recorded FUSE_INIT to be adopted");
  }
  io.backing = options.backing;
  io.table = options.backing_table;
  io.register_backing = options.register_backing;
  io.kernel_offers_passthrough = InitOffers(io.init, kInitFusePassthrough);
  io.killpriv = options.xattrs && InitOffers(io.init, FUSE_HANDLE_KILLPRIV_V2) && KillPrivIsTheExports();
  if (io.backing != nullptr && !io.live && !io.kernel_offers_passthrough) {
    fprintf(stderr, "fkserve: passthrough: the kernel does not offer it (Linux 6.9+, CONFIG_FUSE_PASSTHROUGH)\n");
  }
  // Adopted: the first server's INIT reply decided; the agent refuses backing files if it said no.
  io.passthrough = io.live && io.backing != nullptr;
  fs.set_io(&io);
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
  static const fuse_custom_io custom = {.writev = IoWritev, .read = IoRead,
                                        .splice_receive = nullptr, .splice_send = nullptr};
  if (fuse_session_custom_io(se, &custom, fuse_fd) != 0) {
    fuse_session_destroy(se);
    return absl::InternalError("fuse_session_custom_io failed");
  }
  io.se = se;
  io.stop_fd = options.stop_fd;
  if (io.stop_fd >= 0) fcntl(fuse_fd, F_SETFL, fcntl(fuse_fd, F_GETFL) | O_NONBLOCK);
  // Without a stop fd: SIGTERM (kubelet stopping the container), SIGINT and SIGHUP end the loop
  // cleanly. They need handlers: as PID 1 of a container the server would ignore them otherwise.
  const bool handlers = io.stop_fd < 0 && fuse_set_signal_handlers(se) == 0;
  int r = fuse_session_loop(se);
  if (handlers) fuse_remove_signal_handlers(se);
  fuse_session_destroy(se);
  // The loop ends with 0 on a clean unmount; ENODEV (connection gone) is also a normal end.
  if (r != 0 && r != -ENODEV && r != ENODEV) {
    return absl::InternalError(absl::StrCat("FUSE session ended with error ", r));
  }
  return absl::OkStatus();
}

}  // namespace fusekeeper
