// FUSE passthrough (Linux 6.9, protocol 7.40) as the kernel's include/uapi/linux/fuse.h defines
// it; the <linux/fuse.h> this builds against (7.38) predates it. A server that says
// FUSE_PASSTHROUGH (and a max_stack_depth) in its INIT reply may answer an OPEN or CREATE with
// FOPEN_PASSTHROUGH and a backing id: the kernel then reads, writes and maps that file itself.
// A backing id comes from FUSE_DEV_IOC_BACKING_OPEN on the connection, which needs CAP_SYS_ADMIN
// and records its caller's credentials for the backing file's I/O (fs/fuse/passthrough.c): the
// agent makes that call for its unprivileged servers (backing_broker.h).
#pragma once

#include <linux/fuse.h>
#include <sys/ioctl.h>

#include <cstddef>
#include <cstdint>

namespace fusekeeper {

inline constexpr uint64_t kInitFusePassthrough = 1ULL << 37;  // flags2 bit 5
inline constexpr uint32_t kFopenPassthrough = 1u << 7;
// The depth of file systems stacked under a passthrough mount: its backing files' own.
inline constexpr uint32_t kPassthroughStackDepth = 1;
// fuse_init_out.max_stack_depth is 7.38's unused[0]; fuse_open_out.backing_id its padding.
inline constexpr size_t kInitOutMaxStackDepth = offsetof(fuse_init_out, unused);
inline constexpr size_t kOpenOutBackingId = offsetof(fuse_open_out, padding);

struct FuseBackingMap {
  int32_t fd;
  uint32_t flags;
  uint64_t padding;
};
inline constexpr unsigned long kFuseDevIocBackingOpen = _IOW(229, 1, FuseBackingMap);
inline constexpr unsigned long kFuseDevIocBackingClose = _IOW(229, 2, uint32_t);

}  // namespace fusekeeper
