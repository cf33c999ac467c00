// RelayCore: restoring nodes and handles in a new instance, outliving the launcher (the journal),
// and program instances coming and going.
#include "agent/fkserve/relay/relay_core.h"

#include <fcntl.h>
#include <linux/fs.h>

#include <algorithm>
#include <array>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "agent/fkserve/relay/fuse_wire.h"
#include "agent/fkserve/relay/relay_core_internal.h"

namespace fusekeeper::relay {

using namespace core_internal;  // NOLINT: RelayCore's own helpers

// ---- Restoring nodes and handles in a new instance ----

uint64_t RelayCore::SendOwn(OwnKind kind, uint64_t id, uint32_t opcode, uint64_t nodeid, const std::string& body,
                           const std::string* as) {
  return SendToProgram(opcode, nodeid, body, kind, id, as);
}

void RelayCore::WaitNode(uint64_t kid, Waiter w) {
  node_waiters_[kid].push_back(w);
  StartResolve(kid);
}

void RelayCore::StartResolve(uint64_t kid) {
  Node* n = nodes_.Find(kid);
  if (n == nullptr || n->unresolvable || (n->parent == 0 && kid != kRootId)) {
    Resolved(kid, false);
    return;
  }
  if (n->pid != 0) {
    Resolved(kid, true);
    return;
  }
  if (n->resolving) return;
  n->resolving = true;
  Node* parent = nodes_.Find(n->parent);
  if (parent == nullptr) {
    n->resolving = false;
    Resolved(kid, false);
    return;
  }
  if (parent->pid == 0) {
    WaitNode(n->parent, {Waiter::kNode, kid});
    return;
  }
  SendOwn(OwnKind::kLookup, kid, FUSE_LOOKUP, parent->pid, absl::StrCat(n->name(), std::string(1, '\0')));
}

void RelayCore::Resolved(uint64_t kid, bool ok) {
  if (Node* n = nodes_.Find(kid)) {
    n->resolving = false;
    if (!ok) n->unresolvable = true;
  }
  auto it = node_waiters_.find(kid);
  if (it == node_waiters_.end()) return;
  std::vector<Waiter> waiters = std::move(it->second);
  node_waiters_.erase(it);
  for (const Waiter& w : waiters) {
    switch (w.kind) {
      case Waiter::kRequest:
        Dispatch(w.id);  // fails it if the node stayed unresolved
        break;
      case Waiter::kNode:
        if (Node* child = nodes_.Find(w.id)) child->resolving = false;
        if (ok) {
          StartResolve(w.id);
        } else {
          Resolved(w.id, false);
        }
        break;
      case Waiter::kHandle:
        StartReopen(w.id);
        break;
      case Waiter::kReplay:
        if (ok) {
          ReplayOpen(w.id);
        } else {
          ReplayCreate(w.id);
        }
        break;
      case Waiter::kReplayParent:
        if (ok) {
          ReplayCreate(w.id);
        } else {
          ReplayEnd(w.id, false, "its directory no longer resolves in the restarted program");
        }
        break;
    }
  }
}

void RelayCore::StartReopen(uint64_t kfh) {
  auto it = handles_.find(kfh);
  if (it == handles_.end()) return;
  Handle& h = it->second;
  if (h.instance == instance_) {
    Reopened(kfh, 0);
    return;
  }
  if (h.opening) return;
  Node* n = nodes_.Find(h.kid);
  if (n == nullptr || n->unresolvable || (n->pid == 0 && n->parent == 0 && h.kid != kRootId)) {
    Reopened(kfh, ESTALE);
    return;
  }
  if (n->pid == 0) {
    WaitNode(h.kid, {Waiter::kHandle, kfh});
    return;
  }
  h.opening = true;
  fuse_open_in in{};
  // Reopened as it was opened, less what would change the file again.
  // O_APPEND too: the kernel gives every WRITE its offset (the file's size for an append), and
  // replayed writes must land where they did, not at the end again.
  in.flags = h.flags & ~static_cast<uint32_t>(O_CREAT | O_EXCL | O_TRUNC | O_APPEND);
  SendOwn(OwnKind::kOpen, kfh, h.dir ? FUSE_OPENDIR : FUSE_OPEN, n->pid,
          std::string(reinterpret_cast<const char*>(&in), sizeof(in)));
}

void RelayCore::Reopened(uint64_t kfh, int error) {
  auto it = handles_.find(kfh);
  if (it == handles_.end()) return;
  Handle& h = it->second;
  h.opening = false;
  if (error != 0) {
    h.lost = true;
    h.lost_error = error;
  }
  WakeHandle(kfh);
}

void RelayCore::WakeHandle(uint64_t kfh) {
  auto it = handles_.find(kfh);
  if (it == handles_.end()) return;
  Handle& h = it->second;
  std::vector<uint64_t> waiters = std::move(h.waiters);
  h.waiters.clear();
  for (uint64_t unique : waiters) Dispatch(unique);
}

// A request that may have taken effect in the instance that died: what its name looks like now
// decides. UNLINK, RMDIR, RENAME: a name that is gone was removed by the dead instance (answer
// 0). MKDIR, MKNOD, SYMLINK, LINK: a name that exists was made by it (answer with that entry).
// CREATE: a name that exists may be the dead instance's or another client's; opening it could
// hand the kernel a file it did not create, so EIO. Anything else: sent again.
void RelayCore::Check(Request& r, uint64_t unique) {
  if (r.opcode == FUSE_TMPFILE) {  // no name to look at; a second unnamed file is harmless
    r.check = false;
    Dispatch(unique);
    Checked(unique);
    return;
  }
  Node* dir = nodes_.Find(r.node);
  if (dir == nullptr) {
    Fail(unique, ESTALE, "its directory is unknown to the relay");
    return;
  }
  if (dir->pid == 0) {
    if (dir->unresolvable || (dir->parent == 0 && r.node != kRootId)) {
      Fail(unique, ESTALE, "its directory no longer resolves in the restarted program");
      return;
    }
    WaitNode(r.node, {Waiter::kRequest, unique});
    return;
  }
  SendOwn(OwnKind::kCheck, unique, FUSE_LOOKUP, dir->pid, r.name + std::string(1, '\0'));
}

void RelayCore::OnCheckReply(uint64_t unique, const char* msg, size_t len) {
  auto it = requests_.find(unique);
  const fuse_out_header h = OutHeader(msg);
  const bool exists = h.error == 0 && len >= kOutHeader + sizeof(fuse_entry_out) &&
                      Load<fuse_entry_out>(msg + kOutHeader).nodeid != 0;
  const uint64_t pid = exists ? Load<fuse_entry_out>(msg + kOutHeader).nodeid : 0;
  if (it == requests_.end()) {
    if (exists) ForgetInProgram(pid, 1);
    return;
  }
  Request& r = it->second;
  const bool absent = !exists && (h.error == -ENOENT || h.error == 0);
  auto give_back = [&] {
    if (exists) ForgetInProgram(pid, 1);
  };
  if (!exists && !absent) {
    Fail(unique, EIO, absl::StrCat("could not tell whether the program that died had done it (LOOKUP: ",
                                   strerror(-h.error), ")"));
    return;
  }
  r.check = false;
  switch (r.opcode) {
    case FUSE_UNLINK:
    case FUSE_RMDIR:
    case FUSE_RENAME:
    case FUSE_RENAME2:
      if (absent) {
        ++stats_.done_by_dead;
        if (r.opcode == FUSE_UNLINK || r.opcode == FUSE_RMDIR) {
          nodes_.Unlink(r.node, r.name);
        } else if (nodes_.KidOfName(r.node, r.name) != 0 || (r.flags & RENAME_EXCHANGE) != 0) {
          nodes_.Rename(r.node, r.name, r.node2, r.name2, (r.flags & RENAME_EXCHANGE) != 0);
        }
        // Else the table has the old name no more: the core that died journaled this RENAME's
        // effect before the kernel got its answer. Applied again, the file now under the new
        // name would be taken for one the RENAME replaced, and lose its path.
        RememberAnswer(unique, ErrorReply(unique, 0).data(), kOutHeader);
        Reply(ErrorReply(unique, 0).data(), kOutHeader);
        Complete(unique);
        return;
      }
      give_back();
      Dispatch(unique);
      Checked(unique);  // after its effect on the node table, if any
      return;
    case FUSE_MKDIR:
    case FUSE_MKNOD:
    case FUSE_SYMLINK:
    case FUSE_LINK:
      if (exists) {
        ++stats_.done_by_dead;
        std::string reply(msg, len);
        std::string why;
        // The check's lookup reference becomes the kernel's.
        if (!TranslateReply(r, reply.data(), reply.size(), &why)) {
          Fail(unique, EIO, why);
          return;
        }
        Store<uint64_t>(reply.data() + offsetof(fuse_out_header, unique), unique);
        RememberAnswer(unique, reply.data(), reply.size());
        Reply(reply.data(), reply.size());
        Complete(unique);
        return;
      }
      Dispatch(unique);
      Checked(unique);  // after its effect on the node table, if any
      return;
    case FUSE_CREATE:
      if (exists) {
        give_back();
        Fail(unique, EIO, "the program died while creating it, and it exists now: whether it made it cannot be told");
        return;
      }
      Dispatch(unique);
      Checked(unique);  // after its effect on the node table, if any
      return;
    default:
      give_back();
      Dispatch(unique);
      Checked(unique);  // after its effect on the node table, if any
      return;
  }
}

// ---- Outliving the launcher ----

void RelayCore::SetJournal(StateJournal* journal) {
  journal_ = journal;
  nodes_.TrackChanges();
}

SavedHandle RelayCore::SavedHandleOf(const Handle& h) { return SavedHandle{h.kid, h.flags, h.dir, h.maybe_lost, h.written}; }

void RelayCore::JournalHandle(uint64_t kfh, const Handle& h) {
  if (journal_ != nullptr) journal_->Handle(kfh, SavedHandleOf(h));
}

void RelayCore::FlushJournal() {
  if (journal_ == nullptr) return;
  for (uint64_t kid : nodes_.TakeChanged()) {
    const Node* n = nodes_.Find(kid);
    if (n == nullptr) {
      journal_->NodeGone(kid);
    } else {
      journal_->Node(kid, SavedNodeOf(*n));
    }
  }
  bool ok = journal_->Flush();
  // About what a compaction writes: each node and handle record, and the kept writes.
  const uint64_t live = changes_.bytes() + 64 * (nodes_.size() + handles_.size()) + init_request_.size();
  if (ok && journal_->WantsCompaction(live)) {
    journal_->BeginCompaction();
    WriteState();
    ok = journal_->EndCompaction();
  }
  if (!ok && !journal_failed_) {
    journal_failed_ = true;
    out_->Log(absl::StrCat("relay: writing the relay's state failed (", strerror(errno),
                           "): a launcher that replaces this one may not restore every open file"));
  }
}

void RelayCore::WriteState() {
  if (init_done_) journal_->Init(init_request_, max_write_);
  nodes_.ForEach([&](const Node& n) {
    if (n.kid != kRootId) journal_->Node(n.kid, SavedNodeOf(n));
  });
  for (const auto& [kfh, h] : handles_) JournalHandle(kfh, h);
  for (const auto& [kid, n] : changes_.nodes()) {
    for (uint64_t kfh : n.unsynced_handles) journal_->Unrepeatable(kid, kfh);
    for (const Change& c : n.changes) journal_->Change(kid, c.kfh, c.msg, c.durable);
  }
  for (const SavedAnswer& a : answers_) journal_->Answer(a.unique, a.reply);
}

SavedState RelayCore::SaveForTest() const {
  SavedState s;
  if (init_done_) {
    s.init_request = init_request_;
    s.max_write = max_write_;
  }
  nodes_.ForEach([&](const Node& n) {
    if (n.kid != kRootId) s.nodes[n.kid] = SavedNodeOf(n);
  });
  for (const auto& [kfh, h] : handles_) s.handles[kfh] = SavedHandleOf(h);
  s.changes = changes_;
  s.answers = answers_;
  return s;
}

void RelayCore::Restore(const SavedState& s) {
  if (!s.init_request.empty()) {
    init_request_ = s.init_request;
    max_write_ = s.max_write;
    init_done_ = true;
    stats_.served = true;
  }
  std::vector<uint64_t> handle_kids;
  for (const auto& [kfh, saved] : s.handles) {
    Handle h;
    h.kid = saved.kid;
    h.flags = saved.flags;
    h.dir = saved.dir;
    h.written = saved.written;
    h.maybe_lost = saved.maybe_lost;
    handles_.emplace(kfh, std::move(h));
    handle_kids.push_back(saved.kid);
    next_fh_ = std::max(next_fh_, kfh + 1);
  }
  nodes_.Restore(s.nodes, handle_kids);
  changes_ = s.changes;
  answers_ = s.answers;
  ApplyDeath();  // the program died with the launcher
}

// ---- Program instances ----

void RelayCore::ProgramGone() {
  if (!attached_) return;
  attached_ = false;
  ready_ = false;
  own_.clear();
  node_waiters_.clear();
  replays_.clear();
  checking_.clear();
  after_checks_.clear();  // their requests go back to the queue below
  holding_ = false;
  replays_started_ = false;
  nodes_.NewInstance();
  for (auto& [kfh, h] : handles_) {
    h.opening = false;
    h.priming = false;
    h.waiters.clear();
  }
  ApplyDeath();
  std::vector<uint64_t> poison;
  for (auto& [unique, r] : requests_) {
    if (r.state == State::kSent && IsNonIdempotent(r.opcode)) r.check = true;
    if (r.state != State::kQueued) {
      // A request that is being served each time the program dies may be what kills it.
      if (++r.deaths >= kMaxDeathsPerRequest) {
        poison.push_back(unique);
        continue;
      }
      r.state = State::kQueued;
      queue_.push_back(unique);
    }
  }
  for (uint64_t unique : poison) {
    Fail(unique, EIO, absl::StrCat("the program died ", kMaxDeathsPerRequest,
                                   " times in a row while serving it: not sent again"));
  }
}

void RelayCore::ProgramStarted() {
  if (attached_) ProgramGone();
  attached_ = true;
  ++instance_;
  ++stats_.instances;
  stats_.answers_since_start = 0;
  stats_.program_answers_since_start = 0;
  stats_.program_messages_since_start = 0;
  if (init_done_) {
    // The kernel sends INIT once per connection: replay its INIT; hold everything until answered.
    ready_ = false;
    std::string body = init_request_.substr(kInHeader);
    MaskInitRequest(body.data(), body.size());
    SendOwn(OwnKind::kInit, 0, FUSE_INIT, 0, body);
    return;
  }
  SetReady(/*hold=*/false);
}

void RelayCore::SetReady(bool hold) {
  ready_ = true;
  holding_ = hold;
  replays_started_ = false;
  std::vector<uint64_t> queue = std::move(queue_);
  queue_.clear();
  std::sort(queue.begin(), queue.end());
  for (uint64_t unique : queue) Dispatch(unique);
}

}  // namespace fusekeeper::relay
