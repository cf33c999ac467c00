#include "agent/fkserve/passthrough_init.h"

#include <linux/capability.h>
#include <linux/fuse.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "agent/fuse/passthrough_abi.h"

namespace fusekeeper {

// The INIT request offers `flag` (in flags, or flags2 when FUSE_INIT_EXT is set).
bool InitOffers(const std::string& init, uint64_t flag) {
  if (init.size() < sizeof(fuse_in_header) + sizeof(fuse_init_in)) return false;
  fuse_init_in in;
  memcpy(&in, init.data() + sizeof(fuse_in_header), sizeof(in));
  uint64_t flags = in.flags;
  if (flags & FUSE_INIT_EXT) flags |= uint64_t{in.flags2} << 32;
  return (flags & flag) != 0;
}

// Whether this server may tell the kernel it handles dropping privileges (FUSE_HANDLE_KILLPRIV_V2:
// suid and sgid bits and security.capability, on write, truncate and chown). The kernel then
// marks the mount SB_NOSEC and stops asking the server for security.capability before every
// write (file_remove_privs: a GETXATTR per write otherwise, the cost that kept passthrough
// writes under 0.9 of native). It may when the export's own file system does it for every such
// change this server makes, which it does for a process without CAP_FSETID (should_remove_suid);
// the kernel's passthrough writes run as the identity the agent registered the backing file
// with, which has no capability but CAP_SYS_ADMIN, so they drop privileges there too.
bool KillPrivIsTheExports() {
  __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct d[2]{};
  if (syscall(SYS_capget, &h, d) != 0) return false;
  return (d[CAP_FSETID / 32].effective & (1u << (CAP_FSETID % 32))) == 0;
}

// Our INIT reply, in `msg`: says FUSE_HANDLE_KILLPRIV_V2. False if it is too short.
bool HandleKillPrivInReply(std::string* msg) {
  constexpr size_t kBody = sizeof(fuse_out_header);
  if (msg->size() < kBody + sizeof(fuse_init_out)) return false;
  fuse_init_out out;
  memcpy(&out, msg->data() + kBody, sizeof(out));
  out.flags |= FUSE_HANDLE_KILLPRIV_V2;
  memcpy(msg->data() + kBody, &out, sizeof(out));
  return true;
}

// Our INIT reply, in `msg`: says FUSE_PASSTHROUGH with a stack depth. False if it cannot (short,
// or writeback caching, which the kernel does not combine with passthrough).
bool OfferPassthroughInReply(std::string* msg) {
  constexpr size_t kBody = sizeof(fuse_out_header);
  if (msg->size() < kBody + kInitOutMaxStackDepth + sizeof(uint32_t)) return false;
  fuse_init_out out;
  memcpy(&out, msg->data() + kBody, std::min(sizeof(out), msg->size() - kBody));
  if (out.flags & FUSE_WRITEBACK_CACHE) return false;
  out.flags |= FUSE_INIT_EXT;
  out.flags2 |= static_cast<uint32_t>(kInitFusePassthrough >> 32);
  const uint32_t depth = kPassthroughStackDepth;
  memcpy(msg->data() + kBody, &out, std::min(sizeof(out), msg->size() - kBody));
  memcpy(msg->data() + kBody + kInitOutMaxStackDepth, &depth, sizeof(depth));
  return true;
}

// An OPEN reply (fuse_open_out) or a CREATE reply (fuse_entry_out, then fuse_open_out) in `msg`
// for handle `fh`: FOPEN_PASSTHROUGH with `backing_id`. False if it is not that reply.
bool PassThroughInOpenReply(std::string* msg, uint64_t fh, int32_t backing_id) {
  const size_t body = msg->size() - sizeof(fuse_out_header);  // the caller saw a whole header
  if (body != sizeof(fuse_open_out) && body != sizeof(fuse_entry_out) + sizeof(fuse_open_out)) return false;
  const size_t at = msg->size() - sizeof(fuse_open_out);
  fuse_open_out out;
  memcpy(&out, msg->data() + at, sizeof(out));
  if (out.fh != fh) return false;
  out.open_flags |= kFopenPassthrough;
  memcpy(msg->data() + at, &out, sizeof(out));
  memcpy(msg->data() + at + kOpenOutBackingId, &backing_id, sizeof(backing_id));
  return true;
}

}  // namespace fusekeeper
