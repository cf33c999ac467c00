#include "agent/fkserve/relay/fuse_wire.h"

#include <unistd.h>

#include <cerrno>
#include <cstddef>

#include "absl/strings/str_cat.h"

namespace fusekeeper::relay {

namespace {
constexpr uint32_t kFuseStatx = 52;  // 7.39: a GETATTR with statx fields; its fh is at offset 8
}  // namespace

bool IsNoReply(uint32_t opcode) {
  return opcode == FUSE_FORGET || opcode == FUSE_BATCH_FORGET || opcode == FUSE_INTERRUPT ||
         opcode == FUSE_NOTIFY_REPLY;
}

long FhOffset(uint32_t opcode, const char* msg, size_t len) {
  auto body_has = [len](size_t bytes) { return len >= kInHeader + bytes; };
  switch (opcode) {
    case FUSE_READ:
    case FUSE_WRITE:
    case FUSE_RELEASE:
    case FUSE_RELEASEDIR:
    case FUSE_FLUSH:
    case FUSE_FSYNC:
    case FUSE_FSYNCDIR:
    case FUSE_READDIR:
    case FUSE_READDIRPLUS:
    case FUSE_GETLK:
    case FUSE_SETLK:
    case FUSE_SETLKW:
    case FUSE_FALLOCATE:
    case FUSE_LSEEK:
    case FUSE_IOCTL:
    case FUSE_POLL:
    case FUSE_COPY_FILE_RANGE:  // fh_in; fh_out is translated by the core
      return body_has(8) ? static_cast<long>(kInHeader) : -1;
    case FUSE_GETATTR: {
      if (!body_has(sizeof(fuse_getattr_in))) return -1;
      const auto in = Load<fuse_getattr_in>(msg + kInHeader);
      return (in.getattr_flags & FUSE_GETATTR_FH) ? static_cast<long>(kInHeader + offsetof(fuse_getattr_in, fh)) : -1;
    }
    case kFuseStatx: {
      // struct fuse_statx_in { u32 getattr_flags; u32 reserved; u64 fh; ... }
      if (!body_has(16)) return -1;
      return (Load<uint32_t>(msg + kInHeader) & FUSE_GETATTR_FH) ? static_cast<long>(kInHeader + 8) : -1;
    }
    case FUSE_SETATTR: {
      if (!body_has(sizeof(fuse_setattr_in))) return -1;
      const auto in = Load<fuse_setattr_in>(msg + kInHeader);
      return (in.valid & FATTR_FH) ? static_cast<long>(kInHeader + offsetof(fuse_setattr_in, fh)) : -1;
    }
    default:
      return -1;
  }
}

bool IsNonIdempotent(uint32_t opcode) {
  switch (opcode) {
    case FUSE_MKNOD:
    case FUSE_MKDIR:
    case FUSE_SYMLINK:
    case FUSE_LINK:
    case FUSE_UNLINK:
    case FUSE_RMDIR:
    case FUSE_RENAME:
    case FUSE_RENAME2:
    case FUSE_CREATE:
    case FUSE_TMPFILE:
      return true;
    default:
      return false;
  }
}

bool RepliesWithEntry(uint32_t opcode) {
  return opcode == FUSE_LOOKUP || opcode == FUSE_MKNOD || opcode == FUSE_MKDIR || opcode == FUSE_SYMLINK ||
         opcode == FUSE_LINK || opcode == FUSE_CREATE || opcode == FUSE_TMPFILE;
}

std::string OpName(uint32_t opcode) {
  static const char* const kNames[] = {
      nullptr,     "LOOKUP",   "FORGET",     "GETATTR",     "SETATTR",  "READLINK",   "SYMLINK",     nullptr,
      "MKNOD",     "MKDIR",    "UNLINK",     "RMDIR",       "RENAME",   "LINK",       "OPEN",        "READ",
      "WRITE",     "STATFS",   "RELEASE",    nullptr,       "FSYNC",    "SETXATTR",   "GETXATTR",    "LISTXATTR",
      "REMOVEXATTR", "FLUSH",  "INIT",       "OPENDIR",     "READDIR",  "RELEASEDIR", "FSYNCDIR",    "GETLK",
      "SETLK",     "SETLKW",   "ACCESS",     "CREATE",      "INTERRUPT", "BMAP",      "DESTROY",     "IOCTL",
      "POLL",      "NOTIFY_REPLY", "BATCH_FORGET", "FALLOCATE", "READDIRPLUS", "RENAME2", "LSEEK", "COPY_FILE_RANGE",
      "SETUPMAPPING", "REMOVEMAPPING", "SYNCFS", "TMPFILE",  "STATX"};
  if (opcode < sizeof(kNames) / sizeof(kNames[0]) && kNames[opcode] != nullptr) return kNames[opcode];
  return absl::StrCat("op ", opcode);
}

bool NameAt(const char* msg, size_t len, size_t off, absl::string_view* name) {
  if (off >= len) return false;
  const void* nul = memchr(msg + off, '\0', len - off);
  if (nul == nullptr) return false;
  *name = absl::string_view(msg + off, static_cast<const char*>(nul) - (msg + off));
  return true;
}

void MaskInitRequest(char* body, size_t body_len) {
  // fuse_init_in: major 0, minor 4, max_readahead 8, flags 12, flags2 16.
  if (body_len >= 16) Store<uint32_t>(body + 12, Load<uint32_t>(body + 12) & ~static_cast<uint32_t>(kUnrelayableInitFlags));
  if (body_len >= 20) {
    Store<uint32_t>(body + 16, Load<uint32_t>(body + 16) & ~static_cast<uint32_t>(kUnrelayableInitFlags >> 32));
  }
}

std::string ErrorReply(uint64_t unique, int error) {
  fuse_out_header h{};
  h.len = sizeof(h);
  h.error = -error;
  h.unique = unique;
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

}  // namespace fusekeeper::relay

namespace fusekeeper::relay {

int AskKernelToResend(int kernel_fd) {
  const fuse_out_header resend{sizeof(fuse_out_header), kFuseNotifyResend, 0};
  ssize_t n;
  do {
    n = write(kernel_fd, &resend, sizeof(resend));
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof(resend)) ? 0 : (n < 0 ? errno : EIO);
}

}  // namespace fusekeeper::relay
