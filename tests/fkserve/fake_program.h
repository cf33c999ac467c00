// A FUSE file system in memory that speaks the wire the way a program instance does, for tests
// of the relay core: its "disk" (Disk) outlives instances; each instance (FakeInstance) numbers
// nodes and handles its own way (id_base + inode, id_base + counter), keeps its own lookup
// counts, and records every violation of the protocol the relay makes towards it: a request
// before INIT, a node id or handle it never issued, a FORGET of more than it gave.
//
// And the kernel's side: FakeKernel sends requests with the kernel's numbering (even uniques)
// and collects what the relay answers, checking that each request gets exactly one reply.
#pragma once

#include <fcntl.h>
#include <linux/fuse.h>

#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/fkserve/relay/fuse_wire.h"
#include "agent/fkserve/relay/relay_core.h"

namespace fusekeeper::relay::testing {

struct Inode {
  bool dir = false;
  std::string data;
  std::map<std::string, uint64_t> children;
};

struct Disk {
  std::map<uint64_t, Inode> inodes;  // 1 = root
  uint64_t next_ino = 2;
  Disk() { inodes[1].dir = true; }
  uint64_t Make(uint64_t dir, const std::string& name, bool is_dir, const std::string& data = "") {
    const uint64_t ino = next_ino++;
    inodes[ino].dir = is_dir;
    inodes[ino].data = data;
    inodes[dir].children[name] = ino;
    return ino;
  }
};

template <typename T>
std::string Bytes(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(T));
}

inline std::string Request(uint32_t opcode, uint64_t unique, uint64_t nodeid, const std::string& body) {
  fuse_in_header h{};
  h.len = static_cast<uint32_t>(sizeof(h) + body.size());
  h.opcode = opcode;
  h.unique = unique;
  h.nodeid = nodeid;
  return Bytes(h) + body;
}

inline std::string Reply(uint64_t unique, int error, const std::string& body) {
  fuse_out_header h{};
  h.len = static_cast<uint32_t>(sizeof(h) + body.size());
  h.error = error;
  h.unique = unique;
  return Bytes(h) + body;
}

class FakeInstance {
 public:
  FakeInstance(Disk* disk, uint64_t id_base) : disk_(disk), base_(id_base) {}

  std::vector<std::string> violations;
  uint32_t max_write = 1 << 20;
  // Like s3fs: written data stays in the instance until FSYNC or FLUSH puts it on the disk.
  bool keeps_writes_until_sync = false;
  // Like sshfs: a change (WRITE, a SETATTR of the size) stays in the instance until an FSYNC or
  // FLUSH of the handle it came through (a change by path: of any handle) — and what reaches the
  // disk is only the synced changes, applied in their order: a worst case for the relay.
  bool keeps_changes_per_handle = false;
  // Like s3fs: a file made by CREATE is on the disk (named in its directory) only once a FLUSH
  // or FSYNC of it; until then only this instance knows it.
  bool keeps_creates_until_sync = false;

  // Handles one request; the reply ("" if none is due).
  std::string Handle(const std::string& m) {
    if (m.size() < sizeof(fuse_in_header)) return Violation("short request"), "";
    fuse_in_header h;
    memcpy(&h, m.data(), sizeof(h));
    const char* body = m.data() + sizeof(h);
    const size_t body_len = m.size() - sizeof(h);
    if (h.len != m.size()) Violation(absl::StrCat("header length ", h.len, " != ", m.size()));
    if (h.opcode == FUSE_INIT) {
      inited_ = true;
      fuse_init_out out{};
      out.major = 7;
      out.minor = 38;
      out.flags = FUSE_MAX_PAGES | FUSE_SPLICE_READ;  // asks for splice: the relay must mask it
      out.max_write = max_write;
      out.max_pages = static_cast<uint16_t>(max_write / 4096);
      return Reply(h.unique, 0, Bytes(out));
    }
    if (!inited_) return Violation(absl::StrCat(relay::OpName(h.opcode), " before INIT")), "";
    if (h.opcode == FUSE_FORGET) {
      Forget(h.nodeid, relay::Load<fuse_forget_in>(body).nlookup);
      return "";
    }
    if (h.opcode == FUSE_BATCH_FORGET) {
      const auto b = relay::Load<fuse_batch_forget_in>(body);
      for (uint32_t i = 0; i < b.count; ++i) {
        const auto one = relay::Load<fuse_forget_one>(body + sizeof(b) + i * sizeof(fuse_forget_one));
        Forget(one.nodeid, one.nlookup);
      }
      return "";
    }
    if (h.opcode == FUSE_INTERRUPT) return "";
    uint64_t ino = 0;
    if (!Ino(h.nodeid, &ino)) {
      Violation(absl::StrCat(relay::OpName(h.opcode), " names node ", h.nodeid, ", never issued by this instance"));
      return Reply(h.unique, -ESTALE, "");
    }
    Inode* node = Find(ino);
    if (node == nullptr) return Reply(h.unique, -ESTALE, "");
    auto name_at = [&](size_t off) { return std::string(body + off); };
    switch (h.opcode) {
      case FUSE_LOOKUP: {
        auto it = node->children.find(name_at(0));
        if (it == node->children.end()) {
          for (const auto& [made, where] : unsynced_creates_) {
            if (where.first == ino && where.second == name_at(0)) return Reply(h.unique, 0, Entry(made));
          }
          return Reply(h.unique, -ENOENT, "");
        }
        return Reply(h.unique, 0, Entry(it->second));
      }
      case FUSE_GETATTR: {
        fuse_attr_out out{};
        out.attr.ino = ino;
        out.attr.size = Visible(ino).size();
        return Reply(h.unique, 0, Bytes(out));
      }
      case FUSE_SETATTR: {
        const auto in = relay::Load<fuse_setattr_in>(body);
        if ((in.valid & FATTR_FH) && !CheckFh(in.fh, ino, "SETATTR")) return Reply(h.unique, -EBADF, "");
        if (in.valid & FATTR_SIZE) {
          Change(ino, (in.valid & FATTR_FH) ? in.fh : 0, in.size, std::nullopt);
        }
        fuse_attr_out out{};
        out.attr.ino = ino;
        out.attr.size = Visible(ino).size();
        return Reply(h.unique, 0, Bytes(out));
      }
      case FUSE_MKDIR:
      case FUSE_CREATE: {
        const size_t fixed = h.opcode == FUSE_MKDIR ? sizeof(fuse_mkdir_in) : sizeof(fuse_create_in);
        const std::string name = name_at(fixed);
        if (node->children.count(name)) return Reply(h.unique, -EEXIST, "");
        const uint64_t made = disk_->Make(ino, name, h.opcode == FUSE_MKDIR);
        if (h.opcode == FUSE_CREATE && keeps_creates_until_sync) {
          node->children.erase(name);
          unsynced_creates_[made] = {ino, name};
        }
        std::string out = Entry(made);
        if (h.opcode == FUSE_CREATE) out += Bytes(Open(made));
        return Reply(h.unique, 0, out);
      }
      case FUSE_UNLINK:
      case FUSE_RMDIR: {
        if (node->children.erase(name_at(0)) == 0) return Reply(h.unique, -ENOENT, "");
        return Reply(h.unique, 0, "");
      }
      case FUSE_RENAME2: {
        // Only RENAME_EXCHANGE (of two names in one directory) is needed here.
        const auto in = relay::Load<fuse_rename2_in>(body);
        const std::string from = name_at(sizeof(in));
        const std::string to = name_at(sizeof(in) + from.size() + 1);
        uint64_t to_ino;
        if (!Ino(in.newdir, &to_ino) || to_ino != ino || in.flags != RENAME_EXCHANGE) {
          return Reply(h.unique, -EINVAL, "");
        }
        auto a = node->children.find(from);
        auto b = node->children.find(to);
        if (a == node->children.end() || b == node->children.end()) return Reply(h.unique, -ENOENT, "");
        std::swap(a->second, b->second);
        return Reply(h.unique, 0, "");
      }
      case FUSE_RENAME: {
        const auto in = relay::Load<fuse_rename_in>(body);
        uint64_t to_ino;
        if (!Ino(in.newdir, &to_ino)) {
          Violation(absl::StrCat("RENAME to node ", in.newdir, ", never issued"));
          return Reply(h.unique, -ESTALE, "");
        }
        const std::string from = name_at(sizeof(in));
        const std::string to = name_at(sizeof(in) + from.size() + 1);
        auto it = node->children.find(from);
        if (it == node->children.end()) {
          for (auto& [made, where] : unsynced_creates_) {
            if (where.first == ino && where.second == from) {
              where = {to_ino, to};
              return Reply(h.unique, 0, "");
            }
          }
          return Reply(h.unique, -ENOENT, "");
        }
        const uint64_t moved = it->second;
        node->children.erase(it);
        disk_->inodes[to_ino].children[to] = moved;
        return Reply(h.unique, 0, "");
      }
      case FUSE_OPEN:
      case FUSE_OPENDIR: {
        const fuse_open_out o = Open(ino);
        if (relay::Load<fuse_open_in>(body).flags & O_TRUNC) Change(ino, o.fh, 0, std::nullopt);
        return Reply(h.unique, 0, Bytes(o));
      }
      case FUSE_READDIR:
      case FUSE_READDIRPLUS: {
        // Like libfuse's high-level API: a handle lists its directory once, from offset 0; a
        // fresh handle asked for another offset is a violation (sshfs asserts there).
        const auto in = relay::Load<fuse_read_in>(body);
        if (!CheckFh(in.fh, ino, "READDIR")) return Reply(h.unique, -EBADF, "");
        if (in.offset != 0 && listed_.count(in.fh) == 0) {
          Violation(absl::StrCat("READDIR at offset ", in.offset, " on a handle never read from 0"));
          return Reply(h.unique, -EIO, "");
        }
        listed_.insert(in.fh);
        std::string out;
        uint64_t index = 0;
        for (const auto& [name, child] : node->children) {
          if (++index <= in.offset) continue;
          fuse_dirent d{};
          d.ino = child;
          d.off = index;
          d.namelen = static_cast<uint32_t>(name.size());
          std::string rec = Bytes(d).substr(0, FUSE_NAME_OFFSET) + name;
          rec.resize(FUSE_DIRENT_ALIGN(rec.size()), '\0');
          const size_t plus = h.opcode == FUSE_READDIRPLUS ? sizeof(fuse_entry_out) : 0;
          if (out.size() + plus + rec.size() > in.size) break;
          if (plus) out += Entry(child);  // a lookup reference, as a READDIRPLUS entry is
          out += rec;
        }
        return Reply(h.unique, 0, out);
      }
      case FUSE_READ: {
        const auto in = relay::Load<fuse_read_in>(body);
        if (!CheckFh(in.fh, ino, "READ")) return Reply(h.unique, -EBADF, "");
        const std::string d = Visible(ino);
        return Reply(h.unique, 0, in.offset >= d.size() ? "" : d.substr(in.offset, in.size));
      }
      case FUSE_WRITE: {
        const auto in = relay::Load<fuse_write_in>(body);
        if (!CheckFh(in.fh, ino, "WRITE")) return Reply(h.unique, -EBADF, "");
        const std::string data(body + sizeof(in), body_len - sizeof(in));
        if (keeps_changes_per_handle) {
          Change(ino, in.fh, in.offset, data);
          fuse_write_out out{};
          out.size = static_cast<uint32_t>(data.size());
          return Reply(h.unique, 0, Bytes(out));
        }
        std::string& target = keeps_writes_until_sync ? Cached(ino) : node->data;
        if (target.size() < in.offset + data.size()) target.resize(in.offset + data.size());
        target.replace(in.offset, data.size(), data);
        fuse_write_out out{};
        out.size = static_cast<uint32_t>(data.size());
        return Reply(h.unique, 0, Bytes(out));
      }
      case FUSE_RELEASE:
      case FUSE_RELEASEDIR: {
        const auto in = relay::Load<fuse_release_in>(body);
        if (!CheckFh(in.fh, ino, "RELEASE")) return Reply(h.unique, -EBADF, "");
        open_.erase(in.fh);
        return Reply(h.unique, 0, "");
      }
      case FUSE_FLUSH:
      case FUSE_FSYNC: {
        const uint64_t fh = relay::Load<uint64_t>(body);
        if (!CheckFh(fh, ino, relay::OpName(h.opcode).c_str())) return Reply(h.unique, -EBADF, "");
        if (auto it = cache_.find(ino); it != cache_.end()) {
          node->data = it->second;
          cache_.erase(it);
        }
        Sync(ino, fh);
        if (auto it = unsynced_creates_.find(ino); it != unsynced_creates_.end()) {
          disk_->inodes[it->second.first].children[it->second.second] = ino;
          unsynced_creates_.erase(it);
        }
        return Reply(h.unique, 0, "");
      }
      default:
        return Reply(h.unique, -ENOSYS, "");
    }
  }

  uint64_t lookups(uint64_t ino) const {
    auto it = counts_.find(base_ + ino);
    return it == counts_.end() ? 0 : it->second;
  }
  size_t open_handles() const { return open_.size(); }
  uint64_t base() const { return base_; }

 private:
  void Violation(const std::string& v) { violations.push_back(v); }
  struct PendingChange {
    uint64_t fh;  // 0: by path
    uint64_t offset;  // a WRITE's offset, or the new size
    std::optional<std::string> data;  // a WRITE's data; none: a size change
    bool synced = false;
  };
  struct Pending {
    std::string base;  // the disk's bytes before the first change not synced
    std::vector<PendingChange> changes;
  };
  static void Apply(std::string* d, const PendingChange& c) {
    if (!c.data) {
      d->resize(c.offset);
      return;
    }
    if (d->size() < c.offset + c.data->size()) d->resize(c.offset + c.data->size());
    d->replace(c.offset, c.data->size(), *c.data);
  }
  // What the instance shows: the disk, or in keeps_changes_per_handle mode its base and every change.
  std::string Visible(uint64_t ino) {
    if (auto it = cache_.find(ino); it != cache_.end()) return it->second;
    auto p = pending_.find(ino);
    if (p == pending_.end()) return disk_->inodes[ino].data;
    std::string d = p->second.base;
    for (const PendingChange& c : p->second.changes) Apply(&d, c);
    return d;
  }
  void Change(uint64_t ino, uint64_t fh, uint64_t offset, std::optional<std::string> data) {
    if (!keeps_changes_per_handle) {
      PendingChange c{fh, offset, std::move(data)};
      Apply(keeps_writes_until_sync ? &Cached(ino) : &disk_->inodes[ino].data, c);
      return;
    }
    auto [p, made] = pending_.try_emplace(ino);
    if (made) p->second.base = disk_->inodes[ino].data;
    p->second.changes.push_back(PendingChange{fh, offset, std::move(data)});
  }
  // The changes through fh (and by path) reach the disk — only they, in their order.
  void Sync(uint64_t ino, uint64_t fh) {
    auto p = pending_.find(ino);
    if (p == pending_.end()) return;
    std::string d = p->second.base;
    bool all = true;
    for (PendingChange& c : p->second.changes) {
      if (c.fh == fh || c.fh == 0) c.synced = true;
      if (c.synced) Apply(&d, c);
      all = all && c.synced;
    }
    disk_->inodes[ino].data = d;
    if (all) pending_.erase(p);
  }
  std::string& Cached(uint64_t ino) {
    auto it = cache_.find(ino);
    if (it == cache_.end()) it = cache_.emplace(ino, disk_->inodes[ino].data).first;
    return it->second;
  }
  Inode* Find(uint64_t ino) {
    auto it = disk_->inodes.find(ino);
    return it == disk_->inodes.end() ? nullptr : &it->second;
  }
  bool Ino(uint64_t pid, uint64_t* ino) {
    if (pid == FUSE_ROOT_ID) {
      *ino = 1;
      return true;
    }
    if (counts_.find(pid) == counts_.end()) return false;
    *ino = pid - base_;
    return true;
  }
  std::string Entry(uint64_t ino) {
    fuse_entry_out e{};
    e.nodeid = base_ + ino;
    e.attr.ino = ino;
    e.attr.mode = disk_->inodes[ino].dir ? 040755 : 0100644;
    e.attr.size = Visible(ino).size();
    ++counts_[e.nodeid];
    return Bytes(e);
  }
  fuse_open_out Open(uint64_t ino) {
    fuse_open_out o{};
    o.fh = base_ + 100000 + next_fh_++;
    open_[o.fh] = ino;
    return o;
  }
  bool CheckFh(uint64_t fh, uint64_t ino, const char* op) {
    auto it = open_.find(fh);
    if (it == open_.end() || it->second != ino) {
      Violation(absl::StrCat(op, " with handle ", fh, ", not open on that node in this instance"));
      return false;
    }
    return true;
  }
  void Forget(uint64_t pid, uint64_t n) {
    auto it = counts_.find(pid);
    if (it == counts_.end() || it->second < n) {
      Violation(absl::StrCat("FORGET ", n, " of node ", pid, ", which has ",
                             it == counts_.end() ? 0 : it->second, " lookups"));
      if (it != counts_.end()) counts_.erase(it);
      return;
    }
    if ((it->second -= n) == 0) counts_.erase(it);
  }

  Disk* disk_;
  const uint64_t base_;
  bool inited_ = false;
  std::map<uint64_t, uint64_t> counts_;  // pid → lookups
  std::map<uint64_t, uint64_t> open_;    // fh → ino
  std::map<uint64_t, std::string> cache_;  // ino → data not synced yet
  std::map<uint64_t, Pending> pending_;    // ino → changes not all synced (keeps_changes_per_handle)
  std::map<uint64_t, std::pair<uint64_t, std::string>> unsynced_creates_;  // ino → (directory, name)
  std::set<uint64_t> listed_;              // directory handles read from offset 0
  uint64_t next_fh_ = 1;
};

// The relay's outputs, collected: replies for the kernel by unique, messages for the program.
class Wires : public RelayOutput {
 public:
  void ToKernel(const char* data, size_t len) override {
    std::string m(data, len);
    fuse_out_header h;
    memcpy(&h, data, sizeof(h));
    if (h.unique == 0) {
      notifications.push_back(m);
      return;
    }
    if (replies.count(h.unique)) duplicate_replies.push_back(h.unique);
    replies[h.unique] = m;
  }
  void ToProgram(const iovec* iov, int iovcnt) override {
    std::string m;
    for (int i = 0; i < iovcnt; ++i) m.append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
    to_program.push_back(m);
  }
  void Log(const std::string& line) override { logs.push_back(line); }

  std::map<uint64_t, std::string> replies;
  std::vector<uint64_t> duplicate_replies;
  std::vector<std::string> notifications, to_program, logs;
};

inline int ErrorOf(const std::string& reply) {
  fuse_out_header h;
  memcpy(&h, reply.data(), sizeof(h));
  return h.error;
}

}  // namespace fusekeeper::relay::testing
