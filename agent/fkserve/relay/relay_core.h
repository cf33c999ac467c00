// RelayCore: the launcher's FUSE relay, without I/O. The kernel's /dev/fuse connection stays with
// the launcher; the program it runs gets one end of a SOCK_SEQPACKET socket pair instead, and
// every message passes through here:
//
//   kernel request → FromKernel → (translated) → ToProgram
//   program reply  → FromProgram → (translated) → ToKernel
//
// What it keeps (so that a program instance can die and the next one carry on, the kernel none
// the wiser):
//  - the kernel's FUSE_INIT request (replayed to every new instance, flags masked);
//  - every node the kernel holds (NodeTable: parent, name, lookup counts);
//  - every open file and directory handle: the kernel sees handles the relay issues, mapped to
//    the current instance's (reopened with the original flags on first use after a restart);
//  - every request in flight, as the kernel sent it.
// When the program dies (ProgramGone) the requests it had not answered wait; when the next
// instance is attached (ProgramStarted) it is given the INIT, and then every request is sent to
// it again, translated: a node it has not seen is looked up by path from the root first (one
// LOOKUP per path component, on first use), a handle is reopened first. Requests that may have
// taken effect in the dead instance (MKDIR, UNLINK, RENAME, CREATE...) are checked with a LOOKUP
// before they are sent again (see RelayCore::Check in the .cc for the decision per op).
//
// What cannot be restored fails that one request (the kernel gets an error, never a hang): a
// node with no path (an open file that was unlinked, a name that now means another file) or
// whose path no longer resolves → ESTALE; a handle the new instance refuses to reopen → its
// error; a CREATE the dead instance may have done → EIO. Bad input from the program (short,
// oversized or inconsistent replies, unknown uniques, notifications naming unknown nodes) is
// dropped with a log line, and a request it was meant to answer gets EIO; the relay never
// aborts the connection.
//
// Not thread-safe: one thread (the relay's loop) calls everything.
#pragma once

#include <linux/fuse.h>
#include <stdint.h>
#include <sys/uio.h>

#include <chrono>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "agent/fkserve/relay/change_log.h"
#include "agent/fkserve/relay/durability.h"
#include "agent/fkserve/relay/node_table.h"
#include "agent/fkserve/relay/relay_state.h"

namespace fusekeeper::relay {

class RelayOutput {
 public:
  virtual ~RelayOutput() = default;
  // One whole message for the kernel. Must not block (writes to /dev/fuse never do).
  virtual void ToKernel(const char* data, size_t len) = 0;
  // One whole message for the program: the iovecs concatenated. The data is only valid during
  // the call (copy it to queue it).
  virtual void ToProgram(const iovec* iov, int iovcnt) = 0;
  virtual void Log(const std::string& line) = 0;
};

struct RelayStats {
  uint64_t instances = 0;          // program instances attached
  bool served = false;             // the kernel's INIT was answered: the program has served
  uint64_t requests = 0;           // kernel requests relayed (not counting FORGETs)
  uint64_t resent = 0;             // requests sent again to a new instance
  uint64_t resolved = 0;           // nodes looked up again by path
  uint64_t reopened = 0;           // handles opened again
  uint64_t restore_failures = 0;   // requests failed because what they name could not be restored
  uint64_t bad_messages = 0;       // malformed or unexpected messages from the program
  uint64_t done_by_dead = 0;       // non-idempotent requests found done by the dead instance
  uint64_t writes_replayed = 0;    // changes not yet durable written again into a new instance
  uint64_t files_lost = 0;         // files whose changes a death may have lost (EIO at their next sync)
  uint64_t answers_since_start = 0;  // replies to the kernel since the last ProgramStarted
  uint64_t program_answers_since_start = 0;  // of those, the program's own (not the relay's)
  uint64_t program_messages_since_start = 0;  // messages of any kind from the current instance
};

class RelayCore {
 public:
  // `max_message_bytes`: the largest message the program's socket carries (max_write and
  // max_pages are clamped to fit a WRITE request and a READ reply in it). `durability`: when the
  // program makes a change durable (durability.h), which decides what a death costs: nothing
  // (kAtReply), changes written again (kAtSync: before a new instance sees any request, each
  // file's changes since its handles' last syncs, in their order, then FLUSHed), or an EIO at
  // the next FSYNC/FLUSH of every file that was written (kAtClose: open files; kAtUnmount).
  RelayCore(RelayOutput* out, size_t max_message_bytes, Durability durability = Durability::kAtSync);

  // One request as read from /dev/fuse (len bytes at msg; may be modified).
  void FromKernel(char* msg, size_t len);
  // One message as received from the program (may be modified in place and passed on).
  // `truncated`: it was longer than the buffer it was received in.
  void FromProgram(char* msg, size_t len, bool truncated = false);
  // The program instance is gone (all its processes): what it had not answered waits.
  void ProgramGone();
  // A new instance is connected: it gets the INIT (if the kernel's was answered already), then
  // every waiting request.
  void ProgramStarted();

  // Outliving the launcher (relay_state.h): from now on every change the kernel could come to
  // depend on is written to `journal` before the kernel sees it. Not owned; set before traffic.
  void SetJournal(StateJournal* journal);
  // A dead launcher's state (its journal, Open'ed): the kernel's INIT was answered, and the nodes
  // and handles it holds are known by path and flags, bound in no instance. Requests the dead
  // launcher had read come again from the kernel (FUSE_NOTIFY_RESEND, their unique with bit 63
  // set); those that may have taken effect are checked before they are sent (as after a
  // program's death). Before any traffic.
  void Restore(const SavedState& state);
  // The state as a journal would restore it (tests).
  SavedState SaveForTest() const;

  // The reply the program is about to send for `unique` is read by the core only as far as its
  // header (a READ's: the data goes to the kernel untouched), so FromProgram may be given the
  // header alone with `len` the whole reply's length (in_program.h writes the data from the
  // program's own buffers).
  bool HeaderOnlyReply(uint64_t unique) const;

  bool program_attached() const { return attached_; }
  // The kernel has its INIT answer (the connection is serving).
  bool initialized() const { return init_done_; }
  const RelayStats& stats() const { return stats_; }
  size_t requests_in_flight() const { return requests_.size(); }
  size_t handles() const { return handles_.size(); }
  const NodeTable& nodes() const { return nodes_; }
  uint32_t max_write() const { return max_write_; }

 private:
  enum class State { kQueued, kWaiting, kSent };
  struct Request {
    std::string msg;  // as the kernel sent it
    uint32_t opcode = 0;
    State state = State::kQueued;
    uint64_t instance = 0;  // the instance it was sent to
    bool check = false;     // may have taken effect in a dead instance: look before resending
    int deaths = 0;         // instances that died while it was being served
    uint64_t node = 0;      // header nodeid (kid)
    uint64_t node2 = 0;     // LINK oldnodeid, RENAME newdir, COPY_FILE_RANGE nodeid_out
    std::string name;       // the entry's name in `node` (LOOKUP, MKDIR... LINK, RENAME's old)
    std::string name2;      // RENAME's new name
    uint32_t flags = 0;     // OPEN/CREATE open flags, RENAME2 flags
  };
  struct Handle {
    uint64_t kid = 0;
    uint32_t flags = 0;
    bool dir = false;
    uint64_t pfh = 0;
    uint64_t instance = 0;  // the instance pfh belongs to
    bool opening = false;
    // A directory reopened in this instance, not read from offset 0 yet: libfuse's high-level
    // API (sshfs, bindfs, s3fs...) lists a directory once per handle, from offset 0, and cannot
    // resume a fresh handle elsewhere (sshfs asserts). Read once from 0 before resuming.
    bool needs_prime = false;
    bool priming = false;
    bool written = false;  // a WRITE went through it since it was opened
    // Something written to the file may be gone with a dead instance: its next FSYNC or FLUSH
    // answers EIO instead of a success that would lie (then it is cleared, as the kernel
    // reports a writeback error once).
    bool maybe_lost = false;
    bool lost = false;
    int lost_error = 0;
    std::vector<uint64_t> waiters;  // request uniques
  };
  enum class OwnKind { kInit, kLookup, kOpen, kCheck, kPrime, kReplayOpen, kReplayCreate, kReplayChange, kReplayFlush,
                       kReplayRelease };
  struct Own {
    OwnKind kind;
    uint64_t id;      // kid (kLookup), kernel fh (kOpen, kPrime), kernel unique (kCheck)
    uint32_t opcode;  // what was sent (a primer's READDIR or READDIRPLUS)
  };
  struct Waiter {
    enum Kind { kRequest, kNode, kHandle, kReplay, kReplayParent } kind;
    uint64_t id;
  };

  // Request flow.
  bool ParseRequest(Request& r);
  void Dispatch(uint64_t unique);
  void Send(Request& r, uint64_t unique);
  void Check(Request& r, uint64_t unique);
  // The request is no longer being checked: once none is, the requests held meanwhile go on.
  void Checked(uint64_t unique);
  // A new instance: once nothing is being checked, its kept changes are written again
  // (StartReplays), then the requests held meanwhile go on.
  void MaybeRelease();
  void OnCheckReply(uint64_t unique, const char* msg, size_t len);
  void Complete(uint64_t unique);
  void EraseHandle(uint64_t kfh);
  void Fail(uint64_t unique, int error, const std::string& why);
  void Reply(const char* data, size_t len);
  // Every message to the kernel goes through here: the journal first.
  void ToKernel(const char* data, size_t len);
  void FlushJournal();
  void JournalHandle(uint64_t kfh, const Handle& h);
  static SavedHandle SavedHandleOf(const Handle& h);
  void WriteState();  // the whole state, into a compaction
  void Forgets();
  void ForgetInProgram(uint64_t pid, uint64_t count);
  void OnForget(const char* msg, size_t len);

  // Restoring a node (by path) and a handle (reopen) in the current instance.
  void WaitNode(uint64_t kid, Waiter w);
  void StartResolve(uint64_t kid);
  void Resolved(uint64_t kid, bool ok);
  void StartReopen(uint64_t kfh);
  void Reopened(uint64_t kfh, int error);
  void WakeHandle(uint64_t kfh);
  // A request the program answered without error changes a file or syncs it: what the
  // ChangeLog and the handle learn (takes a WRITE's message: the request is about to complete).
  void NoteChange(Request& r, const char* reply, size_t len);
  // What a death costs under durability_: handles marked maybe_lost; kept changes stay for
  // StartReplays.
  void ApplyDeath();
  // The new instance answered its INIT: every file with kept changes gets them again, one file
  // and one change at a time (a multi-threaded program could reorder a batch), then a FLUSH;
  // requests wait until all are done (a LOOKUP answered before would give the kernel an old size).
  void StartReplays();
  void ReplayOpen(uint64_t kid);
  // A file whose first kept change is its CREATE and that the new instance lacks: made again.
  void ReplayCreate(uint64_t kid);
  const std::string* FirstChange(uint64_t kid) const;  // its request, or null
  void ReplayNext(uint64_t kid);
  void ReplayEnd(uint64_t kid, bool ok, const std::string& why);
  void LoseNode(uint64_t kid, const std::string& why);
  // Asks the kernel to drop what it caches of a file (its pages and attributes).
  void InvalidateInKernel(uint64_t kid);
  // The instance takes requests: the queue goes to Dispatch. `hold`: a new instance of a program
  // that died, whose checks and replays come first (MaybeRelease).
  void SetReady(bool hold);
  // `as`: a kernel request whose uid and gid the relay's own request carries (a file written
  // again is written as the one who wrote it: a program may check, or record, who that is).
  uint64_t SendOwn(OwnKind kind, uint64_t id, uint32_t opcode, uint64_t nodeid, const std::string& body,
                   const std::string* as = nullptr);
  // A request of the relay's own (a unique the kernel never uses) to the program; `reply`: what
  // its reply is for (none for FORGET and BATCH_FORGET). Returns the unique.
  uint64_t SendToProgram(uint32_t opcode, uint64_t nodeid, absl::string_view body,
                         std::optional<OwnKind> reply = std::nullopt, uint64_t id = 0, const std::string* as = nullptr);

  // Replies.
  bool TranslateReply(Request& r, char* msg, size_t len, std::string* why);
  void OnOwnReply(const fuse_out_header& h, const char* msg, size_t len);
  void OnInitReply(char* msg, size_t len, bool replayed);
  void OnNotification(char* msg, size_t len);
  void Bad(const std::string& what);

  RelayOutput* const out_;
  const size_t max_message_;
  NodeTable nodes_;
  std::unordered_map<uint64_t, Request> requests_;  // by kernel unique
  std::vector<uint64_t> queue_;                     // uniques waiting for a ready instance
  std::unordered_map<uint64_t, Handle> handles_;    // by kernel fh
  uint64_t next_fh_ = 1;
  std::unordered_map<uint64_t, Own> own_;           // by own unique
  uint64_t next_own_ = 0;
  const Durability durability_;
  ChangeLog changes_;  // kAtSync: what the program answered and may not have stored
  // The last replies to non-idempotent requests (relay_state.h, SavedAnswer), journaled before
  // the kernel gets them: a resend of one of those is answered from here.
  std::deque<SavedAnswer> answers_;
  void RememberAnswer(uint64_t unique, const char* reply, size_t len);
  // A resent request the relay before this one answered: answered again, true.
  bool AnswerFromJournal(uint64_t unique);
  struct Replay {
    uint64_t pfh = 0;   // the relay's own handle, in the current instance
    size_t next = 0;    // the next change to send
  };
  std::unordered_map<uint64_t, Replay> replays_;  // by kid: files being given their changes again
  std::set<uint64_t> checking_;        // requests being checked (RelayCore::Check)
  std::vector<uint64_t> after_checks_;  // requests held until no request is being checked
  bool holding_ = false;          // a new instance: checks, then replays, before other requests
  bool replays_started_ = false;
  std::unordered_map<uint64_t, std::vector<Waiter>> node_waiters_;
  uint64_t instance_ = 0;  // current instance number (1 = first)
  bool attached_ = false;
  bool ready_ = false;     // attached, and (after a restart) its replayed INIT answered
  bool init_done_ = false;
  std::string init_request_;  // the kernel's INIT, as sent
  uint32_t max_write_ = 0;    // negotiated with the kernel
  RelayStats stats_;
  StateJournal* journal_ = nullptr;
  bool journal_failed_ = false;
};

}  // namespace fusekeeper::relay
