// StateJournal: what a relay must remember to outlive its own launcher, kept in a memfd that the
// agent holds beside the kernel connection (handoff_protocol.h, "relay_state").
//
// A launcher can die too (its container restarted, its image upgraded). The kernel connection
// survives (the agent holds a dup), but a new launcher would know nothing of the node ids and
// file handles the kernel holds: every open file in every pod would fail. So the relay writes
// every change the kernel could come to depend on here *before* the kernel sees it (RelayCore
// flushes before each write to /dev/fuse), and the next launcher reads it back (Open), asks the
// kernel to resend what the dead launcher had read (FUSE_NOTIFY_RESEND) and carries on as after
// a program restart.
//
// What is kept: the kernel's FUSE_INIT and the max_write it was promised; each node the kernel
// holds (kid, parent, name, kernel lookup count); each open handle (node, open flags, whether it
// wrote); and the ChangeLog (change_log.h: per node, the changes a program like s3fs holds until
// it syncs), as the operations made on it, which Parse makes again; and the last kKeptAnswers
// replies to non-idempotent requests (CREATE, MKDIR, RENAME...), as the kernel was to get them.
// Requests in flight are not: the kernel resends them, and a resent one whose reply is kept
// here was done, and journaled, by a relay that died before the kernel got the reply: it is
// answered with that reply, not done twice (a RENAME_EXCHANGE would swap back, a CREATE would
// find its own file).
//
// Layout: a header page at offset 0 ("FKRELAY1", u64 start of the log), then records from
// `start`: u32 length (type + payload), u32 check (FNV-1a of offset, length, type and the first
// 256 bytes of the payload), u8 type, payload, u32 check again (written last: it says the record
// is whole). The log ends at the first record of length 0 or with a bad check (a launcher
// killed in the middle of a write leaves a torn record: it is cut off when the log is opened).
// Records are state, not deltas (a node's whole state each time), so the last one wins.
// Compaction writes the whole state after the end, then moves `start` (one small write), then
// punches out the old log: killed at any point, either the old log or the new one is whole.
//
// Not thread-safe: the relay's loop thread. Writes to a memfd block on memory only.
#pragma once

#include <stdint.h>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "agent/base/unique_fd.h"
#include "agent/fkserve/relay/change_log.h"

namespace fusekeeper::relay {

struct SavedNode {
  uint64_t parent = 0;  // kid; 0: no path
  std::string name;
  uint64_t kernel_lookups = 0;
};

struct SavedHandle {
  uint64_t kid = 0;
  uint32_t flags = 0;
  bool dir = false;
  bool maybe_lost = false;
  bool written = false;  // a WRITE went through it since it was opened
};

// A reply to a non-idempotent request, as the kernel was to get it (`unique` without the resend
// bit).
struct SavedAnswer {
  uint64_t unique = 0;
  std::string reply;
};
// How many are kept: more than the replies that can be journaled and not yet written to the
// kernel when a relay dies (one per thread of the program, at most).
inline constexpr size_t kKeptAnswers = 64;

struct SavedState {
  std::string init_request;  // the kernel's FUSE_INIT; empty: not answered yet
  uint32_t max_write = 0;
  std::map<uint64_t, SavedNode> nodes;      // by kid (the root is implied)
  std::map<uint64_t, SavedHandle> handles;  // by kernel fh
  ChangeLog changes;
  std::deque<SavedAnswer> answers;  // the last kKeptAnswers, oldest first
};

class StateJournal {
 public:
  // A new, empty journal in a new memfd (close-on-exec).
  static absl::StatusOr<std::unique_ptr<StateJournal>> Create();
  // An existing journal (a dead launcher's): reads its state, cuts off a torn tail, and goes on
  // appending after it. INVALID_ARGUMENT (with what is wrong) if it is not a journal or its
  // records do not make sense; the fd is then not taken over.
  static absl::StatusOr<std::unique_ptr<StateJournal>> Open(UniqueFd fd, SavedState* state);
  // Whether `fd` starts like a journal (the agent keeps other servers' states too, e.g. fkserve
  // serve's passthrough table: a launcher that finds one asks for a fresh connection).
  static bool LooksLikeOne(int fd);
  // Parses a journal's bytes (the whole file). For Open and the fuzzer.
  static absl::StatusOr<SavedState> Parse(absl::string_view file, uint64_t* end);

  int fd() const { return fd_.get(); }

  // Records, buffered until Flush (a kept WRITE's, over 4 KiB, is written at once, after what
  // is buffered).
  void Init(absl::string_view init_request, uint32_t max_write);
  void Node(uint64_t kid, const SavedNode& node);
  void NodeGone(uint64_t kid);
  void Handle(uint64_t kfh, const SavedHandle& handle);
  void HandleGone(uint64_t kfh);
  // The ChangeLog's operations, in the order they were made on it (Parse makes them again).
  void Change(uint64_t kid, uint64_t kfh, absl::string_view request, bool durable = false);
  void Unrepeatable(uint64_t kid, uint64_t kfh);
  void Synced(uint64_t kid, uint64_t kfh);
  void DropChanges(uint64_t kid);
  // A reply to a non-idempotent request (SavedAnswer), before the kernel gets it.
  void Answer(uint64_t unique, absl::string_view reply);

  // Writes what is buffered. False if the memfd could not take it (the state kept from then on
  // is incomplete: logged once by the caller; the relay goes on).
  bool Flush();
  // The log has grown past twice `live_bytes` (about what a compaction would write) and 1 MiB:
  // mostly dead records. (A log of live kept writes is not worth copying.)
  bool WantsCompaction(uint64_t live_bytes) const;
  // Compaction: Begin, the whole state as records, End.
  void BeginCompaction();
  bool EndCompaction();

  uint64_t log_bytes() const { return end_ - start_; }

 private:
  explicit StateJournal(UniqueFd fd) : fd_(std::move(fd)) {}
  void Record(char type, absl::string_view a, absl::string_view b = {});
  bool WriteHeader(uint64_t start);

  UniqueFd fd_;
  uint64_t start_ = 0;  // where the current log starts
  uint64_t end_ = 0;    // where the next record goes (past what is flushed)
  std::string pending_;
  uint64_t pending_at_ = 0;  // the offset pending_ is written at
  uint64_t compaction_start_ = 0;  // while compacting: the new log's start
  bool failed_ = false;            // a record written directly failed: the next Flush says so
  bool compacting_ = false;
};

}  // namespace fusekeeper::relay
