// RelayCore: replies from the program.
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
