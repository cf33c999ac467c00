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

}  // namespace fusekeeper::relay
