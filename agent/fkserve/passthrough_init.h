// What fkserve serve changes in the replies libfuse 3.14 writes (it predates passthrough): the
// INIT reply's passthrough and privilege-dropping flags, and an OPEN or CREATE reply's backing id.
// Pure functions on the bytes of one message; passthrough.cc's custom I/O calls them.
#pragma once

#include <cstdint>
#include <string>

namespace fusekeeper {

// The INIT request `init` (header and fuse_init_in) offers `flag` (in flags, or flags2 when
// FUSE_INIT_EXT is set).
bool InitOffers(const std::string& init, uint64_t flag);

// Whether this server may say FUSE_HANDLE_KILLPRIV_V2 (passthrough_init.cc): it runs without
// CAP_FSETID, so the export's file system drops privileges for every change it makes.
bool KillPrivIsTheExports();

// Our INIT reply in `msg` (header and fuse_init_out) says FUSE_HANDLE_KILLPRIV_V2. False if it is
// too short (then unchanged).
bool HandleKillPrivInReply(std::string* msg);

// Our INIT reply in `msg` says FUSE_PASSTHROUGH with a stack depth of 1. False if it cannot
// (short, or writeback caching, which the kernel does not combine with passthrough).
bool OfferPassthroughInReply(std::string* msg);

// An OPEN reply (fuse_open_out) or a CREATE reply (fuse_entry_out, then fuse_open_out) in `msg`
// for handle `fh` gets FOPEN_PASSTHROUGH and `backing_id`. False if it is not that reply.
bool PassThroughInOpenReply(std::string* msg, uint64_t fh, int32_t backing_id);

}  // namespace fusekeeper
