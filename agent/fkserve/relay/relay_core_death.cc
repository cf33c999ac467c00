// RelayCore: what a death costs, and kept changes written again.
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

}  // namespace fusekeeper::relay
