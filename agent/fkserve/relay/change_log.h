// ChangeLog: the changes of each file a relayed program answered but may not have made durable,
// in the order the program made them, so that a restarted program can be given them again.
//
// Only a program that keeps data until FSYNC/FLUSH needs it (durability.h: kAtSync). Per node
// (the kernel's id of a file) it keeps the kernel's requests that change the file's bytes or
// size — WRITE, SETATTR with a size, FALLOCATE, and the CREATE that made it — in one sequence, whichever handle (or none: a
// truncate by path) they came through. An FSYNC or FLUSH answered on a handle makes that handle's
// changes durable, and the changes that came through no handle; a durable change is dropped only
// once every change before it is durable too. Why: written again into a restarted program, a
// suffix of a file's changes in their order gives the file the bytes it had, whatever part of
// that suffix the dead program had already stored — but a change written again alone, out of its
// place (an old WRITE after a later truncate, or after a later WRITE through another handle),
// gives it bytes it never had.
//
// Bounded: a node whose kept changes would pass max_node_bytes, or all nodes' max_total_bytes,
// drops them and is *incomplete* until every handle that changed it since has synced; a change
// that cannot be written again (COPY_FILE_RANGE into the file) makes it incomplete too. A death
// while a node is incomplete loses data: the relay then answers the next FSYNC or FLUSH of each
// of its handles EIO.
//
// Not thread-safe: the relay's loop thread.
#pragma once

#include <stdint.h>

#include <deque>
#include <map>
#include <set>
#include <string>

namespace fusekeeper::relay {

struct Change {
  uint64_t kfh = 0;      // the kernel's handle it came through; 0: none (SETATTR by path)
  bool durable = false;  // synced, but kept behind an older change that is not
  std::string msg;       // the kernel's request, as it sent it
};

struct NodeChanges {
  std::deque<Change> changes;
  uint64_t bytes = 0;
  bool incomplete = false;
  std::set<uint64_t> unsynced_handles;  // while incomplete: handles that changed it since (0: by path)
};

class ChangeLog {
 public:
  static constexpr uint64_t kMaxNodeBytes = 32 << 20;
  static constexpr uint64_t kMaxTotalBytes = 128 << 20;
  explicit ChangeLog(uint64_t max_node_bytes = kMaxNodeBytes, uint64_t max_total_bytes = kMaxTotalBytes)
      : max_node_(max_node_bytes), max_total_(max_total_bytes) {}

  // A change the program answered, to node `kid` through handle `kfh` (0: none). `durable`: only
  // when a journal's compacted state is read back. False: it was not kept (the node is
  // incomplete).
  bool Add(uint64_t kid, uint64_t kfh, std::string msg, bool durable = false);
  // A change that cannot be written again: the node is incomplete until kfh syncs.
  void AddUnrepeatable(uint64_t kid, uint64_t kfh);
  // FSYNC or FLUSH answered without error on handle kfh of node kid.
  void Synced(uint64_t kid, uint64_t kfh);
  // Forgets the node's changes (written again and synced, or given up).
  void Drop(uint64_t kid);

  const NodeChanges* Find(uint64_t kid) const;
  const std::map<uint64_t, NodeChanges>& nodes() const { return nodes_; }
  uint64_t bytes() const { return total_; }
  bool empty() const { return nodes_.empty(); }

 private:
  void MakeIncomplete(NodeChanges& n, uint64_t kfh);
  void Trim(uint64_t kid, NodeChanges& n);

  uint64_t max_node_;
  uint64_t max_total_;
  std::map<uint64_t, NodeChanges> nodes_;  // by kid; a node with nothing kept and complete is absent
  uint64_t total_ = 0;
};

}  // namespace fusekeeper::relay
