// The FUSE wire format as the relay needs it: headers, the opcodes that carry node ids and file
// handles, and the FUSE_INIT flags a relay cannot pass on.
//
// Every accessor copies bytes (memcpy) rather than casting: messages come from other people's
// programs and from recv buffers with no alignment promise, and a short message is never read
// past its end (callers check sizes first with the Has* helpers).
//
// Pure functions; any thread.
#pragma once

#include <linux/fuse.h>
#include <stdint.h>

#include <cstring>
#include <string>

#include "absl/strings/string_view.h"

namespace fusekeeper::relay {

// INIT flags newer than the <linux/fuse.h> this is built against (7.38), from the kernel's
// include/uapi/linux/fuse.h: bit 32 + n is flags2 bit n.
inline constexpr uint64_t kFusePassthrough = 1ULL << 37;   // 7.40: backing files by fd
inline constexpr uint64_t kFuseOverIoUring = 1ULL << 41;   // 7.42: requests on an io_uring
inline constexpr uint64_t kFuseHasResend = 1ULL << 39;     // 7.40
// What a relay cannot pass on: splice moves pages between the device and a pipe (a socket is not
// the device), passthrough and io_uring bind the program to the device fd itself, and DAX is
// virtiofs only. Masked in the INIT request the program sees and in its reply.
inline constexpr uint64_t kUnrelayableInitFlags = uint64_t{FUSE_SPLICE_WRITE} | FUSE_SPLICE_MOVE |
                                                  FUSE_SPLICE_READ | FUSE_MAP_ALIGNMENT | kFusePassthrough |
                                                  kFuseOverIoUring;

// Replies never need more than this for their header and the fixed part of INIT's reply.
inline constexpr size_t kInHeader = sizeof(fuse_in_header);    // 40
inline constexpr size_t kOutHeader = sizeof(fuse_out_header);  // 16

template <typename T>
T Load(const char* p) {
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
void Store(char* p, const T& v) {
  memcpy(p, &v, sizeof(T));
}

inline fuse_in_header InHeader(const char* msg) { return Load<fuse_in_header>(msg); }
inline fuse_out_header OutHeader(const char* msg) { return Load<fuse_out_header>(msg); }

// The uniques the relay uses for its own requests (LOOKUP and OPEN of a restarted program): the
// kernel's are small counters (even; +1 for INTERRUPT), so bit 62 never collides.
inline constexpr uint64_t kOwnUniqueBit = 1ULL << 62;
// A request the kernel sends again after FUSE_NOTIFY_RESEND (7.40, Linux 6.9) has this bit set in
// its unique (FUSE_UNIQUE_RESEND); the reply must carry the same unique.
inline constexpr uint64_t kResendUniqueBit = 1ULL << 63;
inline constexpr int32_t kFuseNotifyResend = 7;  // FUSE_NOTIFY_RESEND

// Asks the kernel to send again every request read from `kernel_fd`'s connection and not answered
// (FUSE_NOTIFY_RESEND, Linux 6.9+: they come back with kResendUniqueBit). 0, or the errno
// (ENODEV: the connection has ended).
int AskKernelToResend(int kernel_fd);

// Requests the kernel expects no reply to.
bool IsNoReply(uint32_t opcode);

// Where a request's body holds a file handle (the first u64 of the body for these ops, and for
// GETATTR/SETATTR only when their flags say so); -1 if none.
long FhOffset(uint32_t opcode, const char* msg, size_t len);

// Requests whose effect a dead program may have completed before it could answer: they are not
// resent blindly (relay_core.cc decides per op).
bool IsNonIdempotent(uint32_t opcode);

// Ops answered with a fuse_entry_out (a new lookup reference on success).
bool RepliesWithEntry(uint32_t opcode);

// Name of an op for logs ("LOOKUP", "op 77").
std::string OpName(uint32_t opcode);

// The NUL-terminated name at `off` of a request; false if there is none within len.
bool NameAt(const char* msg, size_t len, size_t off, absl::string_view* name);

// Clears kUnrelayableInitFlags in a fuse_init_in (the body of an INIT request), as far as the
// body holds its flags (flags2 only if present).
void MaskInitRequest(char* body, size_t body_len);

// A reply carrying only an error (-errno), for the kernel.
std::string ErrorReply(uint64_t unique, int error);

}  // namespace fusekeeper::relay
