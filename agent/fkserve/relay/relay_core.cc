#include "agent/fkserve/relay/relay_core.h"

#include <fcntl.h>
#include <linux/fs.h>

#include <algorithm>
#include <array>
#include <array>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "agent/fkserve/relay/fuse_wire.h"

namespace fusekeeper::relay {

namespace {

constexpr uint32_t kPage = 4096;
// Bytes of a request that may hold ids the relay rewrites (header + the largest fixed part that
// holds one: fuse_copy_file_range_in's fh_out ends at 40 + 32).
constexpr size_t kPatchPrefix = 128;

constexpr int kMaxDeathsPerRequest = 3;

bool IsDot(absl::string_view name) { return name == "." || name == ".."; }

// Where a request holds file handles: FhOffset's, and COPY_FILE_RANGE's fh_out (-1: none).
std::array<long, 2> HandleOffsets(uint32_t opcode, const std::string& msg) {
  return {FhOffset(opcode, msg.data(), msg.size()),
          opcode == FUSE_COPY_FILE_RANGE ? static_cast<long>(kInHeader + offsetof(fuse_copy_file_range_in, fh_out))
                                         : -1};
}

// A node as the journal keeps it.
SavedNode SavedNodeOf(const Node& n) { return SavedNode{n.parent, std::string(n.name()), n.kernel_lookups}; }

bool UsesHeaderNode(uint32_t opcode) {
  return opcode != FUSE_INIT && opcode != FUSE_INTERRUPT && opcode != FUSE_BATCH_FORGET && opcode != FUSE_DESTROY;
}

}  // namespace

RelayCore::RelayCore(RelayOutput* out, size_t max_message_bytes, Durability durability)
    : out_(out), max_message_(max_message_bytes), durability_(durability) {}

// ---- Requests from the kernel ----

bool RelayCore::ParseRequest(Request& r) {
  const char* m = r.msg.data();
  const size_t len = r.msg.size();
  const size_t body = kInHeader;
  auto name_at = [&](size_t off, std::string* out) {
    absl::string_view n;
    if (!NameAt(m, len, off, &n)) return false;
    *out = std::string(n);
    return true;
  };
  switch (r.opcode) {
    case FUSE_LOOKUP:
    case FUSE_UNLINK:
    case FUSE_RMDIR:
    case FUSE_SYMLINK:  // name, then the link's target
      return name_at(body, &r.name);
    case FUSE_MKNOD:
      return name_at(body + sizeof(fuse_mknod_in), &r.name);
    case FUSE_MKDIR:
      return name_at(body + sizeof(fuse_mkdir_in), &r.name);
    case FUSE_CREATE:
      if (len < body + sizeof(fuse_create_in)) return false;
      r.flags = Load<fuse_create_in>(m + body).flags;
      return name_at(body + sizeof(fuse_create_in), &r.name);
    case FUSE_LINK:
      if (len < body + sizeof(fuse_link_in)) return false;
      r.node2 = Load<fuse_link_in>(m + body).oldnodeid;
      return name_at(body + sizeof(fuse_link_in), &r.name);
    case FUSE_RENAME:
    case FUSE_RENAME2: {
      const size_t fixed = r.opcode == FUSE_RENAME ? sizeof(fuse_rename_in) : sizeof(fuse_rename2_in);
      if (len < body + fixed) return false;
      r.node2 = Load<uint64_t>(m + body);
      if (r.opcode == FUSE_RENAME2) r.flags = Load<fuse_rename2_in>(m + body).flags;
      if (!name_at(body + fixed, &r.name)) return false;
      return name_at(body + fixed + r.name.size() + 1, &r.name2);
    }
    case FUSE_OPEN:
    case FUSE_OPENDIR:
      if (len < body + sizeof(fuse_open_in)) return false;
      r.flags = Load<fuse_open_in>(m + body).flags;
      return true;
    case FUSE_COPY_FILE_RANGE:
      if (len < body + sizeof(fuse_copy_file_range_in)) return false;
      r.node2 = Load<fuse_copy_file_range_in>(m + body).nodeid_out;
      return true;
    case FUSE_INIT:
      return len >= body + 16;  // major, minor, max_readahead, flags
    default:
      return true;
  }
}

void RelayCore::FromKernel(char* msg, size_t len) {
  if (len < kInHeader) {
    out_->Log(absl::StrCat("relay: a ", len, "-byte read from the kernel is not a request; ignored"));
    return;
  }
  const fuse_in_header h = InHeader(msg);
  if (h.opcode == FUSE_FORGET || h.opcode == FUSE_BATCH_FORGET) {
    OnForget(msg, len);
    return;
  }
  if (h.opcode == FUSE_INTERRUPT) {
    if (len < kInHeader + sizeof(fuse_interrupt_in)) return;
    const uint64_t target = Load<fuse_interrupt_in>(msg + kInHeader).unique;
    auto it = requests_.find(target);
    // Only the instance working on it can be interrupted; a waiting request is simply sent later.
    if (it != requests_.end() && it->second.state == State::kSent && it->second.instance == instance_ && ready_) {
      iovec iov{msg, len};
      out_->ToProgram(&iov, 1);
    }
    return;
  }
  if (h.opcode == FUSE_NOTIFY_REPLY) {
    // The answer to a program's RETRIEVE: for the instance that asked, if it is still there.
    if (!ready_) return;
    if (h.nodeid != 0) {
      Node* n = nodes_.Find(h.nodeid);
      if (n == nullptr || n->pid == 0) return;
      Store<uint64_t>(msg + offsetof(fuse_in_header, nodeid), n->pid);
    }
    iovec iov{msg, len};
    out_->ToProgram(&iov, 1);
    return;
  }
  if (requests_.count(h.unique) != 0) {
    out_->Log(absl::StrCat("relay: the kernel reused unique ", h.unique, " while it was in flight; ignored"));
    return;
  }
  Request r;
  r.msg.assign(msg, len);
  r.opcode = h.opcode;
  r.node = h.nodeid;
  ++stats_.requests;
  if (!ParseRequest(r)) {
    ToKernel(ErrorReply(h.unique, EINVAL).data(), kOutHeader);
    out_->Log(absl::StrCat("relay: malformed ", OpName(h.opcode), " from the kernel; answered EINVAL"));
    return;
  }
  if (r.opcode == FUSE_INIT && init_request_.empty()) init_request_ = r.msg;
  // Sent again after the launcher before this one died: it may have reached a program instance
  // that did it. Answered already by a core that died before the kernel got the reply: that
  // reply. Else what may have taken effect is looked at first.
  if ((h.unique & kResendUniqueBit) && IsNonIdempotent(r.opcode)) {
    if (AnswerFromJournal(h.unique)) return;
    r.check = true;
  }
  requests_.emplace(h.unique, std::move(r));
  Dispatch(h.unique);
}

void RelayCore::Dispatch(uint64_t unique) {
  auto it = requests_.find(unique);
  if (it == requests_.end()) return;
  Request& r = it->second;
  if (!ready_) {
    if (r.state != State::kQueued || std::find(queue_.begin(), queue_.end(), unique) == queue_.end()) {
      r.state = State::kQueued;
      queue_.push_back(unique);
    }
    return;
  }
  if (r.check) {
    r.state = State::kWaiting;
    checking_.insert(unique);
    Check(r, unique);
    return;
  }
  if (holding_ || checking_.size() > checking_.count(unique)) {
    // A request the dead instance may have done (a RENAME, an UNLINK) is being looked at: until
    // it is decided, a path in the relay's table may be one the program no longer has, and a
    // node resolved by it now would be lost for good. And a new instance's kept changes are
    // written again (after those checks) before anything else reaches it.
    r.state = State::kWaiting;
    after_checks_.push_back(unique);
    return;
  }
  r.state = State::kWaiting;
  // Every node it names must be known to the current instance.
  for (uint64_t kid : {UsesHeaderNode(r.opcode) ? r.node : 0, r.node2}) {
    if (kid == 0) continue;
    Node* n = nodes_.Find(kid);
    if (n == nullptr) {
      Fail(unique, ESTALE, absl::StrCat("node ", kid, " is unknown to the relay"));
      return;
    }
    if (n->pid != 0) continue;
    if (n->unresolvable || (n->parent == 0 && kid != kRootId)) {
      Fail(unique, ESTALE,
           absl::StrCat("node ", kid, n->name().empty() ? " has no path (unlinked or replaced)" : " no longer resolves",
                        " in the restarted program"));
      return;
    }
    WaitNode(kid, {Waiter::kRequest, unique});
    return;
  }
  // And every handle.
  for (long off : HandleOffsets(r.opcode, r.msg)) {
    if (off < 0) continue;
    const uint64_t kfh = Load<uint64_t>(r.msg.data() + off);
    auto h = handles_.find(kfh);
    if (h == handles_.end()) {
      Fail(unique, EBADF, absl::StrCat(OpName(r.opcode), " names file handle ", kfh, ", which the relay never issued"));
      return;
    }
    if (h->second.maybe_lost && r.opcode == FUSE_READ) {
      // The program answers it from what it has, which may not be what was written.
      Fail(unique, EIO, absl::StrCat("file handle ", kfh, ": what was written to the file may be gone with the "
                                     "program that died (its next fsync or close says so)"));
      return;
    }
    if (h->second.instance == instance_) {
      Handle& hd = h->second;
      if (hd.maybe_lost && (r.opcode == FUSE_FSYNC || r.opcode == FUSE_FLUSH)) {
        hd.maybe_lost = false;
        JournalHandle(kfh, hd);
        Fail(unique, EIO, absl::StrCat("writes to file handle ", kfh, " that the program which died had accepted "
                                       "but not synced may be lost"));
        return;
      }
      const bool listing = r.opcode == FUSE_READDIR || r.opcode == FUSE_READDIRPLUS;
      if (listing && hd.needs_prime && r.msg.size() >= kInHeader + sizeof(fuse_read_in)) {
        if (Load<fuse_read_in>(r.msg.data() + kInHeader).offset == 0) {
          hd.needs_prime = false;  // read from 0 anyway
        } else {
          hd.waiters.push_back(unique);
          if (!hd.priming) {
            hd.priming = true;
            fuse_read_in in = Load<fuse_read_in>(r.msg.data() + kInHeader);
            in.fh = hd.pfh;
            in.offset = 0;
            SendOwn(OwnKind::kPrime, kfh, r.opcode, nodes_.Find(hd.kid)->pid,
                    std::string(reinterpret_cast<const char*>(&in), sizeof(in)));
          }
          return;
        }
      }
      continue;
    }
    // (A file's kept changes were written again and flushed before any request was sent.)
    const bool unsynced = h->second.maybe_lost;
    if (r.opcode == FUSE_RELEASE || r.opcode == FUSE_RELEASEDIR || (r.opcode == FUSE_FLUSH && !unsynced)) {
      // Nothing to close or flush in an instance that never opened it.
      if (r.opcode != FUSE_FLUSH) EraseHandle(kfh);
      Reply(ErrorReply(unique, 0).data(), kOutHeader);
      Complete(unique);
      return;
    }
    if (h->second.lost) {
      Fail(unique, h->second.lost_error, absl::StrCat("file handle ", kfh, " could not be reopened"));
      return;
    }
    h->second.waiters.push_back(unique);
    StartReopen(kfh);
    return;
  }
  Send(r, unique);
}

void RelayCore::Send(Request& r, uint64_t unique) {
  char prefix[kPatchPrefix];
  const size_t n = std::min(r.msg.size(), kPatchPrefix);
  memcpy(prefix, r.msg.data(), n);
  if (UsesHeaderNode(r.opcode) && r.node != 0) {
    Store<uint64_t>(prefix + offsetof(fuse_in_header, nodeid), nodes_.Find(r.node)->pid);
  }
  if (r.node2 != 0) {
    const size_t off = r.opcode == FUSE_COPY_FILE_RANGE ? kInHeader + offsetof(fuse_copy_file_range_in, nodeid_out)
                                                        : kInHeader;  // LINK oldnodeid, RENAME(2) newdir
    Store<uint64_t>(prefix + off, nodes_.Find(r.node2)->pid);
  }
  for (long off : HandleOffsets(r.opcode, r.msg)) {
    if (off < 0) continue;
    Store<uint64_t>(prefix + off, handles_.at(Load<uint64_t>(r.msg.data() + off)).pfh);
  }
  if (r.opcode == FUSE_INIT) {
    MaskInitRequest(prefix + kInHeader, n - kInHeader);  // what the relay cannot pass on is not offered
  }
  if (r.instance != 0 && r.instance != instance_) ++stats_.resent;
  r.state = State::kSent;
  r.instance = instance_;
  iovec iov[2] = {{prefix, n}, {r.msg.data() + n, r.msg.size() - n}};
  out_->ToProgram(iov, r.msg.size() > n ? 2 : 1);
}

void RelayCore::Checked(uint64_t unique) {
  if (checking_.erase(unique) != 0) MaybeRelease();
}

void RelayCore::MaybeRelease() {
  if (!checking_.empty()) return;
  if (holding_) {
    if (!replays_started_) {
      replays_started_ = true;
      StartReplays();  // comes back here when they are done
      return;
    }
    if (!replays_.empty()) return;
    holding_ = false;
  }
  std::vector<uint64_t> waiting = std::move(after_checks_);
  after_checks_.clear();
  std::sort(waiting.begin(), waiting.end());
  for (uint64_t u : waiting) Dispatch(u);
}

void RelayCore::Complete(uint64_t unique) {
  Checked(unique);
  auto it = requests_.find(unique);
  if (it == requests_.end()) return;
  Request& r = it->second;
  if ((r.opcode == FUSE_RELEASE || r.opcode == FUSE_RELEASEDIR) && r.msg.size() >= kInHeader + 8) {
    const uint64_t kfh = Load<uint64_t>(r.msg.data() + kInHeader);
    requests_.erase(it);
    EraseHandle(kfh);
    FlushJournal();  // after its answer: no other might follow before the launcher dies
  } else {
    requests_.erase(it);
  }
  Forgets();
}

void RelayCore::EraseHandle(uint64_t kfh) {
  auto h = handles_.find(kfh);
  if (h == handles_.end()) return;
  nodes_.DropHandle(h->second.kid);
  std::vector<uint64_t> waiters = std::move(h->second.waiters);
  handles_.erase(h);
  if (journal_ != nullptr) journal_->HandleGone(kfh);
  // The kernel releases a handle only when nothing uses it; if something did, it fails (EBADF).
  for (uint64_t unique : waiters) Dispatch(unique);
}

void RelayCore::Reply(const char* data, size_t len) {
  ++stats_.answers_since_start;
  ToKernel(data, len);
}

void RelayCore::ToKernel(const char* data, size_t len) {
  FlushJournal();
  out_->ToKernel(data, len);
}

void RelayCore::Fail(uint64_t unique, int error, const std::string& why) {
  auto it = requests_.find(unique);
  if (it == requests_.end()) return;
  ++stats_.restore_failures;
  out_->Log(absl::StrCat("relay: ", OpName(it->second.opcode), " (unique ", unique, ") failed with ",
                         strerror(error), ": ", why));
  Reply(ErrorReply(unique, error).data(), kOutHeader);
  Complete(unique);
}

void RelayCore::OnForget(const char* msg, size_t len) {
  const fuse_in_header h = InHeader(msg);
  if (h.opcode == FUSE_FORGET) {
    if (len >= kInHeader + sizeof(fuse_forget_in)) nodes_.Forget(h.nodeid, Load<fuse_forget_in>(msg + kInHeader).nlookup);
  } else if (len >= kInHeader + sizeof(fuse_batch_forget_in)) {
    const uint32_t count = Load<fuse_batch_forget_in>(msg + kInHeader).count;
    const size_t first = kInHeader + sizeof(fuse_batch_forget_in);
    for (uint32_t i = 0; i < count && first + (i + 1) * sizeof(fuse_forget_one) <= len; ++i) {
      const auto one = Load<fuse_forget_one>(msg + first + i * sizeof(fuse_forget_one));
      nodes_.Forget(one.nodeid, one.nlookup);
    }
  }
  Forgets();
  FlushJournal();  // no reply follows to flush it: a successor would keep nodes the kernel forgot
}

void RelayCore::Forgets() {
  std::vector<ProgramForget> forgets = nodes_.TakeForgets();
  if (forgets.empty() || !ready_) return;  // a dead instance owes nothing
  std::string body;
  fuse_batch_forget_in b{};
  b.count = static_cast<uint32_t>(forgets.size());
  body.append(reinterpret_cast<const char*>(&b), sizeof(b));
  for (const ProgramForget& f : forgets) {
    fuse_forget_one one{f.pid, f.count};
    body.append(reinterpret_cast<const char*>(&one), sizeof(one));
  }
  SendToProgram(FUSE_BATCH_FORGET, 0, body);
}

void RelayCore::ForgetInProgram(uint64_t pid, uint64_t count) {
  const fuse_forget_in f{count};
  SendToProgram(FUSE_FORGET, pid, absl::string_view(reinterpret_cast<const char*>(&f), sizeof(f)));
}

uint64_t RelayCore::SendToProgram(uint32_t opcode, uint64_t nodeid, absl::string_view body,
                                  std::optional<OwnKind> reply, uint64_t id, const std::string* as) {
  fuse_in_header h{};
  if (as != nullptr && as->size() >= kInHeader) {
    h.uid = InHeader(as->data()).uid;
    h.gid = InHeader(as->data()).gid;
  }
  h.len = static_cast<uint32_t>(kInHeader + body.size());
  h.opcode = opcode;
  h.unique = kOwnUniqueBit | (next_own_++ << 1);
  h.nodeid = nodeid;
  // uid/gid/pid 0: the relay's own requests are not any process's; default_permissions checks
  // were made by the kernel when the node was first reached.
  if (reply) own_[h.unique] = {*reply, id, opcode};  // before sending: the reply may come at once
  iovec iov[2] = {{&h, sizeof(h)}, {const_cast<char*>(body.data()), body.size()}};
  out_->ToProgram(iov, body.empty() ? 1 : 2);
  return h.unique;
}

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

// ---- What a death costs, and kept changes written again ----

void RelayCore::ApplyDeath() {
  const bool lossy = durability_ == Durability::kAtClose || durability_ == Durability::kAtUnmount;
  std::set<uint64_t> written;  // files written through any of their handles
  for (const auto& [kfh, h] : handles_) {
    if (lossy && h.written) written.insert(h.kid);
  }
  std::vector<uint64_t> lost;  // kernel handles
  for (auto& [kfh, h] : handles_) {
    bool gone = false;
    if (lossy) {
      gone = written.count(h.kid) != 0;  // every handle of such a file: a reader's too
    } else if (durability_ == Durability::kAtSync) {
      const NodeChanges* n = changes_.Find(h.kid);
      gone = n != nullptr && n->incomplete;
    }
    if (gone && !h.maybe_lost) {
      h.maybe_lost = true;
      lost.push_back(kfh);
      JournalHandle(kfh, h);
    }
  }
  std::set<uint64_t> lost_nodes;
  for (uint64_t kfh : lost) lost_nodes.insert(handles_.at(kfh).kid);
  for (uint64_t kid : lost_nodes) InvalidateInKernel(kid);
  if (!lost.empty()) {
    stats_.files_lost += lost.size();
    out_->Log(absl::StrCat("relay: ", lost.size(), " open file(s) had writes the program (which stores them at ",
                           DurabilityName(durability_), ") may have lost when it died: their next fsync or close "
                           "reports EIO"));
  }
  if (durability_ == Durability::kAtUnmount) {
    out_->Log("relay: the program stores what is written only when it is unmounted: everything written since "
              "the mount is gone with it");
  }
}

void RelayCore::StartReplays() {
  std::vector<uint64_t> kids;
  for (const auto& [kid, n] : changes_.nodes()) {
    if (!n.changes.empty()) kids.push_back(kid);
  }
  for (uint64_t kid : kids) {
    Node* n = nodes_.Find(kid);
    if (n == nullptr) {
      // Neither open nor known to the kernel any more: nobody is left to tell.
      out_->Log(absl::StrCat("relay: node ", kid, " had changes the program may not have stored, and is gone"));
      changes_.Drop(kid);
      if (journal_ != nullptr) journal_->DropChanges(kid);
      continue;
    }
    replays_[kid] = Replay{};
  }
  if (replays_.empty()) {
    MaybeRelease();
    return;
  }
  for (uint64_t kid : kids) {
    if (replays_.count(kid) == 0) continue;
    Node* n = nodes_.Find(kid);
    if (n->pid != 0) {
      ReplayOpen(kid);
    } else {
      WaitNode(kid, {Waiter::kReplay, kid});
    }
  }
}

void RelayCore::ReplayOpen(uint64_t kid) {
  Node* n = nodes_.Find(kid);
  if (n == nullptr || n->pid == 0) {
    ReplayEnd(kid, false, "it no longer resolves in the restarted program");
    return;
  }
  fuse_open_in in{};
  in.flags = O_WRONLY;
  SendOwn(OwnKind::kReplayOpen, kid, FUSE_OPEN, n->pid, std::string(reinterpret_cast<const char*>(&in), sizeof(in)),
          FirstChange(kid));
}

const std::string* RelayCore::FirstChange(uint64_t kid) const {
  const NodeChanges* nc = changes_.Find(kid);
  return nc == nullptr || nc->changes.empty() ? nullptr : &nc->changes.front().msg;
}

void RelayCore::ReplayCreate(uint64_t kid) {
  const NodeChanges* nc = changes_.Find(kid);
  Node* n = nodes_.Find(kid);
  if (nc == nullptr || nc->changes.empty() || InHeader(nc->changes.front().msg.data()).opcode != FUSE_CREATE ||
      n == nullptr || n->parent == 0) {
    ReplayEnd(kid, false, "it no longer resolves in the restarted program");
    return;
  }
  Node* parent = nodes_.Find(n->parent);
  if (parent == nullptr) {
    ReplayEnd(kid, false, "its directory is unknown");
    return;
  }
  if (parent->pid == 0) {
    WaitNode(n->parent, {Waiter::kReplayParent, kid});
    return;
  }
  // Made again where it is now (it may have been renamed since), empty, for writing.
  const std::string& made = nc->changes.front().msg;
  fuse_create_in in = Load<fuse_create_in>(made.data() + kInHeader);
  in.flags = O_WRONLY | O_CREAT;
  SendOwn(OwnKind::kReplayCreate, kid, FUSE_CREATE, parent->pid,
          absl::StrCat(absl::string_view(reinterpret_cast<const char*>(&in), sizeof(in)), n->name(), std::string(1, '\0')),
          &made);
}

void RelayCore::ReplayNext(uint64_t kid) {
  auto it = replays_.find(kid);
  const NodeChanges* nc = changes_.Find(kid);
  Node* n = nodes_.Find(kid);
  if (it == replays_.end() || n == nullptr) return;
  Replay& rp = it->second;
  if (nc == nullptr || rp.next >= nc->changes.size()) {
    fuse_flush_in in{};
    in.fh = rp.pfh;
    SendOwn(OwnKind::kReplayFlush, kid, FUSE_FLUSH, n->pid, std::string(reinterpret_cast<const char*>(&in), sizeof(in)),
            FirstChange(kid));
    return;
  }
  const std::string& msg = nc->changes[rp.next].msg;
  const uint32_t opcode = InHeader(msg.data()).opcode;
  if (opcode == FUSE_CREATE) {  // the file exists (it resolved, or was just made again)
    ++rp.next;
    ReplayNext(kid);
    return;
  }
  std::string body = msg.substr(kInHeader);
  switch (opcode) {
    case FUSE_WRITE:
      Store<uint64_t>(body.data() + offsetof(fuse_write_in, fh), rp.pfh);
      break;
    case FUSE_SETATTR: {  // only its size is a change of the file's bytes
      fuse_setattr_in in = Load<fuse_setattr_in>(body.data());
      fuse_setattr_in size{};
      size.valid = FATTR_SIZE | FATTR_FH;
      size.size = in.size;
      size.fh = rp.pfh;
      body.assign(reinterpret_cast<const char*>(&size), sizeof(size));
      break;
    }
    case FUSE_FALLOCATE:
      Store<uint64_t>(body.data() + offsetof(fuse_fallocate_in, fh), rp.pfh);
      break;
    default:
      break;
  }
  ++stats_.writes_replayed;
  SendOwn(OwnKind::kReplayChange, kid, opcode, n->pid, body, &msg);
}

void RelayCore::ReplayEnd(uint64_t kid, bool ok, const std::string& why) {
  auto it = replays_.find(kid);
  if (it == replays_.end()) return;
  const uint64_t pfh = it->second.pfh;
  replays_.erase(it);
  Node* n = nodes_.Find(kid);
  if (pfh != 0 && n != nullptr && n->pid != 0) {
    fuse_release_in in{};
    in.fh = pfh;
    in.flags = O_WRONLY;
    SendOwn(OwnKind::kReplayRelease, kid, FUSE_RELEASE, n->pid, std::string(reinterpret_cast<const char*>(&in), sizeof(in)));
  }
  if (!ok) LoseNode(kid, why);
  if (replays_.empty()) MaybeRelease();
}

void RelayCore::LoseNode(uint64_t kid, const std::string& why) {
  const Node* n = nodes_.Find(kid);
  out_->Log(absl::StrCat("relay: changes to '", n != nullptr ? std::string(n->name()) : std::string("?"), "' (node ", kid,
                         ") the program that died may not have stored could not be written again: ", why,
                         "; the next fsync or close of each of its open files reports EIO"));
  ++stats_.files_lost;
  changes_.Drop(kid);
  if (journal_ != nullptr) journal_->DropChanges(kid);
  for (auto& [kfh, h] : handles_) {
    if (h.kid != kid || h.maybe_lost) continue;
    h.maybe_lost = true;
    JournalHandle(kfh, h);
  }
  InvalidateInKernel(kid);
}

void RelayCore::InvalidateInKernel(uint64_t kid) {
  // The kernel's pages and size of the file are what was written, not what the program has
  // now: dropped, so that what is read next reaches the program (through a lost handle: EIO).
  fuse_notify_inval_inode_out inval{};
  inval.ino = kid;
  inval.off = 0;
  inval.len = 0;  // to the end
  fuse_out_header h{};
  h.len = static_cast<uint32_t>(kOutHeader + sizeof(inval));
  h.error = FUSE_NOTIFY_INVAL_INODE;
  h.unique = 0;
  std::string msg(reinterpret_cast<const char*>(&h), kOutHeader);
  msg.append(reinterpret_cast<const char*>(&inval), sizeof(inval));
  ToKernel(msg.data(), msg.size());
}

// ---- Replies from the program ----

void RelayCore::Bad(const std::string& what) {
  ++stats_.bad_messages;
  out_->Log(absl::StrCat("relay: bad message from the program: ", what));
}

void RelayCore::FromProgram(char* msg, size_t len, bool truncated) {
  ++stats_.program_messages_since_start;
  if (len < kOutHeader) {
    Bad(absl::StrCat("a ", len, "-byte message"));
    return;
  }
  const fuse_out_header h = OutHeader(msg);
  auto fail_its_request = [&](const std::string& what) {
    Bad(absl::StrCat(what, " (unique ", h.unique, ")"));
    auto it = requests_.find(h.unique);
    if (it != requests_.end() && it->second.state == State::kSent && it->second.instance == instance_) {
      Fail(h.unique, EIO, "the program's reply was malformed");
    }
  };
  if (truncated) {
    fail_its_request(absl::StrCat("a message over ", max_message_, " bytes"));
    return;
  }
  if (h.len != len) {
    fail_its_request(absl::StrCat("its header says ", h.len, " bytes, the message has ", len,
                                  h.len > len ? " (a reply written in pieces, e.g. spliced without fkserve's preload "
                                                "library: each FUSE message must be one write)"
                                              : ""));
    return;
  }
  if (h.unique == 0) {
    OnNotification(msg, len);
    return;
  }
  if (h.error > 0 || h.error <= -512 || (h.error != 0 && len != kOutHeader)) {
    fail_its_request(absl::StrCat("error ", h.error, " in a ", len, "-byte reply"));
    return;
  }
  if (h.unique & kOwnUniqueBit) {
    OnOwnReply(h, msg, len);
    return;
  }
  if (h.unique & 1) {
    // The answer to an INTERRUPT (EAGAIN: ask again later), for the kernel.
    auto it = requests_.find(h.unique & ~1ULL);
    if (it != requests_.end() && it->second.state == State::kSent && it->second.instance == instance_) {
      ToKernel(msg, len);
    }
    return;
  }
  auto it = requests_.find(h.unique);
  if (it == requests_.end() || it->second.state != State::kSent || it->second.instance != instance_) {
    Bad(absl::StrCat("a reply to unique ", h.unique, ", which is not waiting for one"));
    return;
  }
  Request& r = it->second;
  if (h.error == 0) {
    std::string why;
    if (!TranslateReply(r, msg, len, &why)) {
      Bad(absl::StrCat("its ", OpName(r.opcode), " reply ", why));
      Fail(h.unique, EIO, "the program's reply was malformed");
      return;
    }
  }
  if (h.error == 0) NoteChange(r, msg, len);
  for (const NodeTable::LostPath& lost : nodes_.TakeLostPaths()) {
    out_->Log(absl::StrCat("relay: node ", lost.kid, ", open, lost its path '", lost.name, "' at the program's ",
                           OpName(r.opcode), " reply (unique ", h.unique,
                           "): if the program dies, it cannot be reopened (ESTALE)"));
  }
  ++stats_.program_answers_since_start;
  if (IsNonIdempotent(r.opcode)) RememberAnswer(h.unique, msg, len);
  Reply(msg, len);
  Complete(h.unique);
}

void RelayCore::RememberAnswer(uint64_t unique, const char* reply, size_t len) {
  if (journal_ == nullptr || len > 4096) return;
  const uint64_t base = unique & ~kResendUniqueBit;
  answers_.push_back(SavedAnswer{base, std::string(reply, len)});
  if (answers_.size() > kKeptAnswers) answers_.pop_front();
  journal_->Answer(base, answers_.back().reply);  // flushed before the reply is written (ToKernel)
}

bool RelayCore::AnswerFromJournal(uint64_t unique) {
  const uint64_t base = unique & ~kResendUniqueBit;
  for (const SavedAnswer& a : answers_) {
    if (a.unique != base) continue;
    std::string reply = a.reply;
    Store<uint64_t>(reply.data() + offsetof(fuse_out_header, unique), unique);
    ++stats_.done_by_dead;
    out_->Log(absl::StrCat("relay: ", unique, " was answered by the relay that died, before the kernel got the "
                           "answer: answered again, not done twice"));
    Reply(reply.data(), reply.size());
    return true;
  }
  return false;
}

bool RelayCore::HeaderOnlyReply(uint64_t unique) const {
  auto it = requests_.find(unique);
  return it != requests_.end() && it->second.opcode == FUSE_READ && it->second.state == State::kSent &&
         it->second.instance == instance_;
}

void RelayCore::NoteChange(Request& r, const char* reply, size_t len) {
  const bool keep = durability_ == Durability::kAtSync;
  auto add = [&](uint64_t kid, uint64_t kfh, std::string msg) {
    if (changes_.Add(kid, kfh, std::move(msg))) {
      if (journal_ != nullptr) journal_->Change(kid, kfh, changes_.Find(kid)->changes.back().msg);
    } else {
      if (journal_ != nullptr) journal_->Unrepeatable(kid, kfh);
    }
  };
  const long off = FhOffset(r.opcode, r.msg.data(), r.msg.size());
  const uint64_t kfh = off >= 0 ? Load<uint64_t>(r.msg.data() + off) : 0;
  // A change of the file's size or blocks by other means than a WRITE: every open handle of it
  // counts as written (what a death of a close/unmount program loses).
  auto written = [&](uint64_t kid) {
    for (auto& [fh, h] : handles_) {
      if (h.kid == kid && !h.written) {
        h.written = true;
        JournalHandle(fh, h);
      }
    }
  };
  switch (r.opcode) {
    case FUSE_WRITE: {
      auto it = handles_.find(kfh);
      if (it == handles_.end()) return;
      if (!it->second.written) {
        it->second.written = true;
        JournalHandle(kfh, it->second);
      }
      if (keep) add(it->second.kid, kfh, std::move(r.msg));
      return;
    }
    case FUSE_SETATTR: {
      if (r.msg.size() < kInHeader + sizeof(fuse_setattr_in)) return;
      const auto in = Load<fuse_setattr_in>(r.msg.data() + kInHeader);
      if (!(in.valid & FATTR_SIZE)) return;
      written(r.node);
      if (keep) add(r.node, (in.valid & FATTR_FH) ? in.fh : 0, std::move(r.msg));
      return;
    }
    case FUSE_FALLOCATE:
      written(r.node);
      if (keep && handles_.count(kfh)) add(r.node, kfh, std::move(r.msg));
      return;
    case FUSE_OPEN: {
      // Opened with O_TRUNC (the kernel's atomic_o_trunc): a truncate to 0, kept as one.
      if (!keep || !(r.flags & O_TRUNC) || len < kOutHeader + sizeof(fuse_open_out)) return;
      const uint64_t opened = Load<fuse_open_out>(reply + kOutHeader).fh;
      fuse_setattr_in in{};
      in.valid = FATTR_SIZE | FATTR_FH;
      in.fh = opened;
      fuse_in_header h = InHeader(r.msg.data());
      h.opcode = FUSE_SETATTR;
      h.len = static_cast<uint32_t>(kInHeader + sizeof(in));
      add(r.node, opened,
          std::string(reinterpret_cast<const char*>(&h), kInHeader) + std::string(reinterpret_cast<const char*>(&in), sizeof(in)));
      return;
    }
    case FUSE_CREATE: {
      // The file itself may not exist for the program until it syncs (s3fs makes the object at
      // FLUSH): kept as the file's first change, and made again if a new instance lacks it.
      if (!keep || len < kOutHeader + sizeof(fuse_entry_out) + sizeof(fuse_open_out)) return;
      const uint64_t kid = Load<fuse_entry_out>(reply + kOutHeader).nodeid;
      const uint64_t opened = Load<fuse_open_out>(reply + kOutHeader + sizeof(fuse_entry_out)).fh;
      if (kid != 0 && handles_.count(opened)) add(kid, opened, std::move(r.msg));
      return;
    }
    case FUSE_COPY_FILE_RANGE: {
      if (!keep || r.msg.size() < kInHeader + sizeof(fuse_copy_file_range_in)) return;
      const auto in = Load<fuse_copy_file_range_in>(r.msg.data() + kInHeader);
      changes_.AddUnrepeatable(r.node2, in.fh_out);
      if (journal_ != nullptr) journal_->Unrepeatable(r.node2, in.fh_out);
      return;
    }
    case FUSE_FSYNC:
    case FUSE_FLUSH: {
      auto it = handles_.find(kfh);
      if (it == handles_.end() || changes_.Find(it->second.kid) == nullptr) return;
      changes_.Synced(it->second.kid, kfh);
      if (journal_ != nullptr) journal_->Synced(it->second.kid, kfh);
      return;
    }
    default:
      return;
  }
}

bool RelayCore::TranslateReply(Request& r, char* msg, size_t len, std::string* why) {
  const size_t body = kOutHeader;
  auto entry = [&](size_t off, uint64_t parent, const std::string& name, uint64_t* kid) {
    if (len < off + sizeof(fuse_entry_out)) {
      *why = absl::StrCat("is ", len, " bytes, too short for its entry");
      return false;
    }
    const uint64_t pid = Load<uint64_t>(msg + off);
    *kid = 0;
    if (pid == 0) return r.opcode == FUSE_LOOKUP || (*why = "names node 0", false);
    *kid = nodes_.AddKernelEntry(parent, name, pid);
    Store<uint64_t>(msg + off, *kid);
    return true;
  };
  auto open_handle = [&](size_t off, uint64_t kid, bool dir) {
    if (len < off + sizeof(fuse_open_out)) {
      *why = absl::StrCat("is ", len, " bytes, too short for its open handle");
      return false;
    }
    Handle h;
    h.kid = kid;
    h.flags = r.flags;
    h.dir = dir;
    h.pfh = Load<uint64_t>(msg + off);
    h.instance = instance_;
    const uint64_t kfh = next_fh_++;
    JournalHandle(kfh, h);
    handles_.emplace(kfh, std::move(h));
    nodes_.AddHandle(kid);
    Store<uint64_t>(msg + off, kfh);
    return true;
  };
  uint64_t kid = 0;
  switch (r.opcode) {
    case FUSE_INIT:
      OnInitReply(msg, len, /*replayed=*/false);
      return true;
    case FUSE_LOOKUP:
    case FUSE_MKNOD:
    case FUSE_MKDIR:
    case FUSE_SYMLINK:
    case FUSE_LINK:
      return entry(body, r.node, r.name, &kid);
    case FUSE_TMPFILE:
    case FUSE_CREATE:
      if (!entry(body, r.opcode == FUSE_CREATE ? r.node : 0, r.name, &kid)) return false;
      if (!open_handle(body + sizeof(fuse_entry_out), kid, false)) {
        nodes_.Forget(kid, 1);  // the kernel will not have it
        return false;
      }
      return true;
    case FUSE_OPEN:
    case FUSE_OPENDIR:
      return open_handle(body, r.node, r.opcode == FUSE_OPENDIR);
    case FUSE_READDIRPLUS: {
      // Validate all entries first: the kernel takes a lookup reference on every named one.
      std::vector<std::pair<size_t, absl::string_view>> named;
      for (size_t pos = body; pos < len;) {
        if (len - pos < FUSE_NAME_OFFSET_DIRENTPLUS) {
          *why = "ends inside an entry";
          return false;
        }
        const auto d = Load<fuse_dirent>(msg + pos + sizeof(fuse_entry_out));
        const size_t rec = FUSE_DIRENT_ALIGN(FUSE_NAME_OFFSET_DIRENTPLUS + d.namelen);
        if (d.namelen > 1024 || FUSE_NAME_OFFSET_DIRENTPLUS + d.namelen > len - pos) {
          *why = "has an entry running past its end";
          return false;
        }
        const absl::string_view name(msg + pos + FUSE_NAME_OFFSET_DIRENTPLUS, d.namelen);
        if (Load<uint64_t>(msg + pos) != 0 && !IsDot(name)) named.emplace_back(pos, name);
        pos += std::min(rec, len - pos);
      }
      for (const auto& [pos, name] : named) {
        const uint64_t got = nodes_.AddKernelEntry(r.node, name, Load<uint64_t>(msg + pos));
        Store<uint64_t>(msg + pos, got);
      }
      return true;
    }
    case FUSE_RENAME:
    case FUSE_RENAME2:
      nodes_.Rename(r.node, r.name, r.node2, r.name2, (r.flags & RENAME_EXCHANGE) != 0);
      return true;
    case FUSE_UNLINK:
    case FUSE_RMDIR:
      nodes_.Unlink(r.node, r.name);
      return true;
    default:
      return true;
  }
}

void RelayCore::OnInitReply(char* msg, size_t len, bool replayed) {
  // fuse_init_out: major 0, minor 4, max_readahead 8, flags 12, max_background 16,
  // congestion_threshold 18, max_write 20, time_gran 24, max_pages 28, map_alignment 30, flags2 32.
  const size_t b = kOutHeader;
  if (len < b + 24) {  // libfuse2 answers the 7.12-era 24 bytes at least
    out_->Log("relay: the program's INIT reply is too short to read");
    return;
  }
  Store<uint32_t>(msg + b + 12, Load<uint32_t>(msg + b + 12) & ~static_cast<uint32_t>(kUnrelayableInitFlags));
  if (len >= b + 36) {
    Store<uint32_t>(msg + b + 32, Load<uint32_t>(msg + b + 32) & ~static_cast<uint32_t>(kUnrelayableInitFlags >> 32));
  }
  // A WRITE request (header + fuse_write_in + data) and a READ reply must fit one message.
  const uint32_t fit = static_cast<uint32_t>((max_message_ - kInHeader - sizeof(fuse_write_in)) / kPage * kPage);
  uint32_t max_write = Load<uint32_t>(msg + b + 20);
  if (replayed) {
    if (max_write < max_write_) {
      out_->Log(absl::StrCat("relay: the restarted program takes writes of ", max_write,
                             " bytes at most, the kernel was promised ", max_write_, ": larger writes will fail"));
    }
    return;
  }
  max_write = std::max<uint32_t>(kPage, std::min(max_write, fit));
  Store<uint32_t>(msg + b + 20, max_write);
  max_write_ = max_write;
  if (len >= b + 30 && (Load<uint32_t>(msg + b + 12) & FUSE_MAX_PAGES)) {
    const uint16_t pages = Load<uint16_t>(msg + b + 28);
    Store<uint16_t>(msg + b + 28, static_cast<uint16_t>(std::max<uint32_t>(1, std::min<uint32_t>(pages, fit / kPage))));
  }
  init_done_ = true;
  stats_.served = true;
  if (journal_ != nullptr) journal_->Init(init_request_, max_write_);
}

void RelayCore::OnOwnReply(const fuse_out_header& h, const char* msg, size_t len) {
  auto it = own_.find(h.unique);
  if (it == own_.end()) {
    Bad(absl::StrCat("a reply to the relay's unique ", h.unique, ", which is not waiting for one"));
    return;
  }
  const Own own = it->second;
  own_.erase(it);
  switch (own.kind) {
    case OwnKind::kInit: {
      if (h.error != 0) {
        out_->Log(absl::StrCat("relay: the restarted program refused INIT: ", strerror(-h.error)));
        return;  // it will exit; the next instance tries again
      }
      std::string copy(msg, len);
      OnInitReply(copy.data(), copy.size(), /*replayed=*/true);
      // First what the dead instance may have done is checked, then kept changes are written
      // again, then everything else goes (MaybeRelease).
      SetReady(/*hold=*/true);
      MaybeRelease();
      Forgets();
      return;
    }
    case OwnKind::kLookup: {
      const bool ok = h.error == 0 && len >= kOutHeader + sizeof(fuse_entry_out) &&
                      Load<fuse_entry_out>(msg + kOutHeader).nodeid != 0;
      if (ok) {
        ++stats_.resolved;
        nodes_.BindResolved(own.id, Load<fuse_entry_out>(msg + kOutHeader).nodeid);
      } else if (Node* n = nodes_.Find(own.id)) {
        out_->Log(absl::StrCat("relay: '", n->name(), "' (node ", own.id, ") no longer resolves in the restarted program: ",
                               h.error != 0 ? strerror(-h.error) : "no entry"));
      }
      Resolved(own.id, ok);
      Forgets();
      return;
    }
    case OwnKind::kOpen: {
      auto hit = handles_.find(own.id);
      if (hit == handles_.end()) return;  // released meanwhile: nothing to give back (the program closes on exit)
      if (h.error == 0 && len >= kOutHeader + sizeof(fuse_open_out)) {
        ++stats_.reopened;
        hit->second.pfh = Load<fuse_open_out>(msg + kOutHeader).fh;
        hit->second.instance = instance_;
        hit->second.needs_prime = hit->second.dir;
        Reopened(own.id, 0);
      } else {
        Reopened(own.id, h.error != 0 ? -h.error : EIO);
      }
      return;
    }
    case OwnKind::kCheck:
      OnCheckReply(own.id, msg, len);
      return;
    case OwnKind::kReplayOpen:
      if (h.error != 0 || len < kOutHeader + sizeof(fuse_open_out)) {
        ReplayEnd(own.id, false, absl::StrCat("opening it for writing: ", h.error != 0 ? strerror(-h.error) : "short reply"));
        return;
      }
      if (auto rp = replays_.find(own.id); rp != replays_.end()) {
        rp->second.pfh = Load<fuse_open_out>(msg + kOutHeader).fh;
        ReplayNext(own.id);
      }
      return;
    case OwnKind::kReplayCreate:
      if (h.error != 0 || len < kOutHeader + sizeof(fuse_entry_out) + sizeof(fuse_open_out) ||
          Load<fuse_entry_out>(msg + kOutHeader).nodeid == 0) {
        ReplayEnd(own.id, false, absl::StrCat("making it again: ", h.error != 0 ? strerror(-h.error) : "bad reply"));
        return;
      }
      nodes_.BindResolved(own.id, Load<fuse_entry_out>(msg + kOutHeader).nodeid);
      if (auto rp = replays_.find(own.id); rp != replays_.end()) {
        rp->second.pfh = Load<fuse_open_out>(msg + kOutHeader + sizeof(fuse_entry_out)).fh;
        ++stats_.writes_replayed;
        ReplayNext(own.id);
      }
      Forgets();
      return;
    case OwnKind::kReplayChange:
      if (h.error != 0) {
        ReplayEnd(own.id, false, absl::StrCat(OpName(own.opcode), ": ", strerror(-h.error)));
        return;
      }
      if (auto rp = replays_.find(own.id); rp != replays_.end()) {
        ++rp->second.next;
        ReplayNext(own.id);
      }
      return;
    case OwnKind::kReplayFlush:
      if (h.error == 0) {
        // Stored again: nothing of it is at risk any more.
        changes_.Drop(own.id);
        if (journal_ != nullptr) journal_->DropChanges(own.id);
      }
      // ENOSYS: the program has no FLUSH; its changes are back where they were before it died.
      ReplayEnd(own.id, h.error == 0 || h.error == -ENOSYS, absl::StrCat("FLUSH: ", strerror(-h.error)));
      return;
    case OwnKind::kReplayRelease:
      return;
    case OwnKind::kPrime: {
      // The listing read from 0 only to let the program resume: give back the lookups a
      // READDIRPLUS took (the kernel never sees these entries).
      for (size_t pos = kOutHeader; h.error == 0 && pos + FUSE_NAME_OFFSET_DIRENTPLUS <= len;) {
        const auto d = Load<fuse_dirent>(msg + pos + sizeof(fuse_entry_out));
        const size_t rec = FUSE_DIRENT_ALIGN(FUSE_NAME_OFFSET_DIRENTPLUS + d.namelen);
        if (d.namelen > 1024 || pos + FUSE_NAME_OFFSET_DIRENTPLUS + d.namelen > len) break;
        const absl::string_view name(msg + pos + FUSE_NAME_OFFSET_DIRENTPLUS, d.namelen);
        const uint64_t pid = Load<uint64_t>(msg + pos);
        if (own.opcode == FUSE_READDIRPLUS && pid != 0 && !IsDot(name)) ForgetInProgram(pid, 1);
        pos += rec;
      }
      auto hit = handles_.find(own.id);
      if (hit == handles_.end()) return;
      hit->second.priming = false;
      hit->second.needs_prime = false;
      WakeHandle(own.id);
      return;
    }
  }
}

void RelayCore::OnNotification(char* msg, size_t len) {
  const fuse_out_header h = OutHeader(msg);
  const char* body = msg + kOutHeader;
  auto translate = [&](size_t off, const char* what) {
    if (len < kOutHeader + off + 8) {
      Bad(absl::StrCat("a short ", what, " notification"));
      return false;
    }
    const uint64_t pid = Load<uint64_t>(body + off);
    const uint64_t kid = pid == kRootId ? kRootId : nodes_.KidOfPid(pid);
    if (kid == 0) {
      Bad(absl::StrCat("a ", what, " notification naming node ", pid, ", which the kernel does not know"));
      return false;
    }
    Store<uint64_t>(msg + kOutHeader + off, kid);
    return true;
  };
  switch (h.error) {
    case FUSE_NOTIFY_POLL:
      break;
    case FUSE_NOTIFY_INVAL_INODE:
      if (!translate(offsetof(fuse_notify_inval_inode_out, ino), "INVAL_INODE")) return;
      break;
    case FUSE_NOTIFY_INVAL_ENTRY:
      if (!translate(offsetof(fuse_notify_inval_entry_out, parent), "INVAL_ENTRY")) return;
      break;
    case FUSE_NOTIFY_DELETE:
      if (!translate(offsetof(fuse_notify_delete_out, parent), "DELETE") ||
          !translate(offsetof(fuse_notify_delete_out, child), "DELETE")) {
        return;
      }
      break;
    case FUSE_NOTIFY_STORE:
      if (!translate(offsetof(fuse_notify_store_out, nodeid), "STORE")) return;
      break;
    case FUSE_NOTIFY_RETRIEVE:
      if (!translate(offsetof(fuse_notify_retrieve_out, nodeid), "RETRIEVE")) return;
      break;
    default:
      // RESEND and later codes concern the device itself, which the program does not hold.
      Bad(absl::StrCat("notification ", h.error, ", which the relay does not pass on"));
      return;
  }
  ToKernel(msg, len);
}

}  // namespace fusekeeper::relay
