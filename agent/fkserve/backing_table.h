// BackingTable: which open file handles of a FUSE connection pass through to which backing id,
// kept in a memfd that outlives the server (fkserve serve --passthrough).
//
// The kernel takes one backing file per inode: while any file of an inode is open in passthrough,
// every other open of it must name the same backing file (another: EBUSY, and the open fails
// with EIO). A server that adopts a live connection must therefore know which backing id each
// inode its predecessor left open uses, and when the last handle naming an id is released
// (whichever server opened it), so that the id is closed then and not before. The other way round
// too: while a file of an inode is open the ordinary way (cached: the agent was away or refused),
// an open of it must not pass through (EIO) until those are closed. The table records one slot
// per handle of either kind (generation-tagged, so unique across servers) and is deposited
// with the agent like a relay's state (handoff_protocol.h): the agent keeps it, and the ids, for
// the next server, which adopts it; a server hands it back to a restarted agent with the
// connection. A connection's servers and the agent are the only ones that hold it, and the
// connection dies when they all do, so the table lives exactly as long as the ids it names.
//
// Crash safety: a slot's fields are written before the flag that makes it count, and the flag is
// cleared first on release, so a server killed at any point leaves only whole slots. What a kill
// can cost: an id registered but not yet recorded, or recorded for an open the kernel never saw
// answered (it resends that open to the successor, which records its own handle); such an id
// stays registered until the connection ends.
//
// Threading: one thread (fkserve's FUSE session).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"

namespace fusekeeper {

class BackingTable {
 public:
  // Handles passed through at once, per connection.
  static constexpr uint32_t kDefaultCapacity = 1u << 18;

  // A new, empty table in a memfd of its own.
  static absl::StatusOr<std::unique_ptr<BackingTable>> Create(uint32_t capacity = kDefaultCapacity);
  // The table a predecessor deposited. INVALID_ARGUMENT if `fd` is not one (another kind of state,
  // a wrong size, or growable: a peer could shrink it under us).
  static absl::StatusOr<std::unique_ptr<BackingTable>> Adopt(UniqueFd fd);
  ~BackingTable();
  BackingTable(const BackingTable&) = delete;
  BackingTable& operator=(const BackingTable&) = delete;

  // The memfd, to deposit (the caller dups it).
  int fd() const { return fd_.get(); }
  // The backing id the open files of `nodeid` pass through to, or 0 if none is open.
  int32_t IdOf(uint64_t nodeid) const;
  // Whether a file of `nodeid` is open the ordinary way (kCached).
  bool HasCachedOpens(uint64_t nodeid) const { return cached_of_node_.count(nodeid) != 0; }
  // Records handle `fh` of `nodeid` passing through `id`, or open the ordinary way (kCached).
  // False if the table is full: the open must then be neither (direct I/O is what the kernel
  // allows beside both).
  static constexpr int32_t kCached = 0;
  bool Add(uint64_t fh, uint64_t nodeid, int32_t id);
  // Forgets handle `fh` (released): the id to close if it was the last handle naming it, else 0
  // (also for a handle that never passed through).
  int32_t Remove(uint64_t fh);
  size_t handles() const { return by_fh_.size(); }
  size_t ids() const { return handles_of_id_.size(); }

 private:
  struct Slot;
  BackingTable(UniqueFd fd, void* map, uint32_t capacity);
  // Rebuilds the in-memory indexes from the slots (Adopt).
  void Index();
  // Counts a recorded handle of `nodeid` in the indexes.
  void Count(uint64_t nodeid, int32_t id);

  UniqueFd fd_;
  void* map_ = nullptr;
  uint32_t capacity_ = 0;
  Slot* slots_ = nullptr;
  std::map<uint64_t, uint32_t> by_fh_;            // handle → slot
  std::map<uint64_t, int32_t> id_of_node_;        // node id → its backing id
  std::map<int32_t, uint32_t> handles_of_id_;     // backing id → handles naming it
  std::map<uint64_t, uint32_t> cached_of_node_;   // node id → its handles open the ordinary way
  uint32_t high_ = 0;                             // slots at and above it were never used
  std::vector<uint32_t> free_;                    // free slots below high_
};

}  // namespace fusekeeper
