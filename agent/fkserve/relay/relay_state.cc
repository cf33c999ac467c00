#include "agent/fkserve/relay/relay_state.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fusekeeper::relay {

namespace {

constexpr char kMagic[8] = {'F', 'K', 'R', 'E', 'L', 'A', 'Y', '1'};
constexpr uint64_t kPage = 4096;
constexpr size_t kRecordHeader = 8;   // u32 length, u32 check
constexpr size_t kRecordTrailer = 4;  // u32 check again: the record's last bytes
// The check covers a record's offset, type, length and the first bytes of its payload; the
// trailer (written last: a write to a memfd fills it in order) says the whole record is there.
// Checking every byte of a kept 1 MiB WRITE cost more than the relay's copies of it.
constexpr size_t kCheckedPayload = 256;
// Payloads larger than this (kept WRITEs) are written straight from the caller's bytes.
constexpr size_t kDirectPayload = 4096;
// A journal larger than this is not one of ours (the relay's bounds keep it far below).
constexpr uint64_t kMaxJournalBytes = 1ULL << 30;
constexpr size_t kMaxName = 1024;
constexpr size_t kWriteHeader = 40 + 40;  // fuse_in_header + fuse_write_in
constexpr size_t kInHeaderBytes = 40;     // fuse_in_header
constexpr size_t kOutHeaderBytes = 16;    // fuse_out_header

uint64_t RoundUp(uint64_t v) { return (v + kPage - 1) / kPage * kPage; }

uint32_t Fnv(uint32_t h, absl::string_view bytes) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 16777619u;
  }
  return h;
}

uint32_t Check(uint64_t offset, char type, absl::string_view a, absl::string_view b) {
  const uint32_t len = static_cast<uint32_t>(1 + a.size() + b.size());
  uint32_t h = Fnv(2166136261u, absl::string_view(reinterpret_cast<const char*>(&offset), sizeof(offset)));
  h = Fnv(h, absl::string_view(reinterpret_cast<const char*>(&len), sizeof(len)));
  h = Fnv(h, absl::string_view(&type, 1));
  h = Fnv(h, a.substr(0, kCheckedPayload));
  return Fnv(h, b.substr(0, kCheckedPayload - std::min(a.size(), kCheckedPayload)));
}

template <typename T>
void Put(std::string* s, T v) {
  s->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// Reads fixed fields off a record's payload, front to back.
class Reader {
 public:
  explicit Reader(absl::string_view p) : p_(p) {}
  template <typename T>
  bool Get(T* v) {
    if (p_.size() < sizeof(T)) return false;
    memcpy(v, p_.data(), sizeof(T));
    p_.remove_prefix(sizeof(T));
    return true;
  }
  absl::string_view rest() const { return p_; }

 private:
  absl::string_view p_;
};

// pwritev until all of iov is written.
bool PwritevAll(int fd, iovec* iov, int count, uint64_t offset) {
  while (count > 0) {
    const ssize_t n = pwritev(fd, iov, count, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    offset += static_cast<uint64_t>(n);
    for (size_t left = static_cast<size_t>(n); count > 0 && left > 0;) {
      const size_t take = std::min(left, iov->iov_len);
      iov->iov_base = static_cast<char*>(iov->iov_base) + take;
      iov->iov_len -= take;
      left -= take;
      if (iov->iov_len == 0) {
        ++iov;
        --count;
      }
    }
    while (count > 0 && iov->iov_len == 0) {
      ++iov;
      --count;
    }
  }
  return true;
}

bool PwriteAll(int fd, const char* data, size_t len, uint64_t offset) {
  while (len > 0) {
    const ssize_t n = pwrite(fd, data, len, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    len -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StateJournal>> StateJournal::Create() {
  UniqueFd fd(memfd_create("fkserve-relay-state", MFD_CLOEXEC));
  if (!fd.valid()) return absl::InternalError(absl::StrCat("memfd_create: ", strerror(errno)));
  std::unique_ptr<StateJournal> j(new StateJournal(std::move(fd)));
  j->start_ = j->end_ = j->pending_at_ = kPage;
  if (!j->WriteHeader(kPage)) return absl::InternalError(absl::StrCat("writing the relay state: ", strerror(errno)));
  return j;
}

bool StateJournal::WriteHeader(uint64_t start) {
  char header[16];
  memcpy(header, kMagic, 8);
  memcpy(header + 8, &start, 8);
  return PwriteAll(fd_.get(), header, sizeof(header), 0);
}

bool StateJournal::LooksLikeOne(int fd) {
  char magic[8];
  return pread(fd, magic, sizeof(magic), 0) == static_cast<ssize_t>(sizeof(magic)) && memcmp(magic, kMagic, 8) == 0;
}

absl::StatusOr<SavedState> StateJournal::Parse(absl::string_view file, uint64_t* end) {
  auto bad = [](const std::string& why) { return absl::InvalidArgumentError(absl::StrCat("relay state: ", why)); };
  if (file.size() < 16 || memcmp(file.data(), kMagic, 8) != 0) return bad("not a relay state journal");
  uint64_t start;
  memcpy(&start, file.data() + 8, 8);
  if (start < kPage || start % kPage != 0 || start > kMaxJournalBytes) return bad(absl::StrCat("log start ", start));
  SavedState s;
  uint64_t off = start;
  while (off + kRecordHeader + kRecordTrailer <= file.size()) {
    uint32_t len, check;
    memcpy(&len, file.data() + off, 4);
    memcpy(&check, file.data() + off + 4, 4);
    // The end, or a torn record (cut short, or whose trailer never got written).
    if (len == 0 || len > file.size() - off - kRecordHeader - kRecordTrailer) break;
    const char type = file[off + kRecordHeader];
    const absl::string_view payload = file.substr(off + kRecordHeader + 1, len - 1);
    uint32_t trailer;
    memcpy(&trailer, file.data() + off + kRecordHeader + len, 4);
    if (Check(off, type, payload, {}) != check || trailer != check) break;
    Reader r(payload);
    const std::string at = absl::StrCat(" at offset ", off);
    switch (type) {
      case 'I': {
        uint32_t max_write;
        if (!r.Get(&max_write) || r.rest().size() < 40 || r.rest().size() > kPage) return bad("bad INIT record" + at);
        s.init_request = std::string(r.rest());
        s.max_write = max_write;
        break;
      }
      case 'N': {
        uint64_t kid, parent, lookups;
        if (!r.Get(&kid) || !r.Get(&parent) || !r.Get(&lookups) || kid <= 1 || r.rest().size() > kMaxName ||
            r.rest().find_first_of(absl::string_view("/\0", 2)) != absl::string_view::npos ||
            (parent != 0 && r.rest().empty())) {
          return bad("bad node record" + at);
        }
        s.nodes[kid] = SavedNode{parent, std::string(r.rest()), lookups};
        break;
      }
      case 'n':
      case 'h': {
        uint64_t id;
        if (!r.Get(&id) || !r.rest().empty()) return bad("bad removal record" + at);
        if (type == 'n') {
          s.nodes.erase(id);
        } else {
          s.handles.erase(id);
        }
        break;
      }
      case 'H': {
        uint64_t kfh, kid, written;
        uint32_t flags;
        uint8_t dir, maybe_lost;
        if (!r.Get(&kfh) || !r.Get(&kid) || !r.Get(&flags) || !r.Get(&dir) || !r.Get(&maybe_lost) ||
            !r.Get(&written) || !r.rest().empty() || kfh == 0 || kid == 0 || dir > 1 || maybe_lost > 1) {
          return bad("bad handle record" + at);
        }
        SavedHandle& h = s.handles[kfh];
        // A launcher before the ChangeLog wrote a handle's record again with 0 here when it synced
        // (its 'W' records follow it otherwise); this launcher never clears `written`.
        if (h.written && written == 0) s.changes.Synced(h.kid, kfh);
        h = SavedHandle{kid, flags, dir == 1, maybe_lost == 1, written != 0};
        break;
      }
      case 'W': {  // a launcher before the ChangeLog: a WRITE kept per handle (kept per node now)
        uint64_t kfh;
        if (!r.Get(&kfh) || r.rest().size() < kWriteHeader) return bad("bad write record" + at);
        auto h = s.handles.find(kfh);
        if (h == s.handles.end()) return bad(absl::StrCat("a write kept for handle ", kfh, ", which is not open", at));
        h->second.written = true;
        s.changes.Add(h->second.kid, kfh, std::string(r.rest()));
        break;
      }
      case 'C':
      case 'U':
      case 'Y':
      case 'D': {
        uint64_t kid, kfh = 0;
        uint8_t durable = 0;
        if (!r.Get(&kid) || kid == 0 || (type != 'D' && !r.Get(&kfh)) || (type == 'C' && !r.Get(&durable)) ||
            durable > 1 || (type == 'C' ? r.rest().size() < kInHeaderBytes : !r.rest().empty())) {
          return bad("bad change record" + at);
        }
        if (type == 'C') s.changes.Add(kid, kfh, std::string(r.rest()), durable == 1);
        if (type == 'U') s.changes.AddUnrepeatable(kid, kfh);
        if (type == 'Y') s.changes.Synced(kid, kfh);
        if (type == 'D') s.changes.Drop(kid);
        break;
      }
      case 'A': {
        uint64_t unique;
        if (!r.Get(&unique) || unique == 0 || r.rest().size() < kOutHeaderBytes || r.rest().size() > kPage) {
          return bad("bad answer record" + at);
        }
        uint32_t reply_len;
        memcpy(&reply_len, r.rest().data(), 4);
        if (reply_len != r.rest().size()) return bad("bad answer record" + at);
        s.answers.push_back(SavedAnswer{unique, std::string(r.rest())});
        if (s.answers.size() > kKeptAnswers) s.answers.pop_front();
        break;
      }
      default:
        return bad(absl::StrCat("unknown record type ", static_cast<int>(type), at));
    }
    off += kRecordHeader + len + kRecordTrailer;
  }
  *end = std::max<uint64_t>(off, start);
  return s;
}

absl::StatusOr<std::unique_ptr<StateJournal>> StateJournal::Open(UniqueFd fd, SavedState* state) {
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return absl::InternalError(absl::StrCat("relay state: fstat: ", strerror(errno)));
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError("relay state: not a regular file (memfd)");
  if (static_cast<uint64_t>(st.st_size) > kMaxJournalBytes) {
    return absl::InvalidArgumentError(absl::StrCat("relay state: ", st.st_size, " bytes is more than any relay keeps"));
  }
  std::string file(static_cast<size_t>(st.st_size), '\0');
  for (size_t got = 0; got < file.size();) {
    const ssize_t n = pread(fd.get(), file.data() + got, file.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::InternalError(absl::StrCat("relay state: reading: ", n < 0 ? strerror(errno) : "short"));
    got += static_cast<size_t>(n);
  }
  uint64_t end = 0;
  auto parsed = Parse(file, &end);
  if (!parsed.ok()) return parsed.status();
  // What follows the last whole record (a torn one) goes: new records are appended after it.
  if (end < file.size() && ftruncate(fd.get(), static_cast<off_t>(end)) != 0) {
    return absl::InternalError(absl::StrCat("relay state: cutting off a torn record: ", strerror(errno)));
  }
  uint64_t start;
  memcpy(&start, file.data() + 8, 8);
  std::unique_ptr<StateJournal> j(new StateJournal(std::move(fd)));
  j->start_ = start;
  j->end_ = j->pending_at_ = end;
  *state = std::move(*parsed);
  return j;
}

void StateJournal::Record(char type, absl::string_view a, absl::string_view b) {
  const uint64_t offset = end_;
  Put<uint32_t>(&pending_, static_cast<uint32_t>(1 + a.size() + b.size()));
  const uint32_t check = Check(offset, type, a, b);
  Put<uint32_t>(&pending_, check);
  pending_.push_back(type);
  if (a.size() + b.size() > kDirectPayload) {
    // A kept WRITE: written from where it is, after what is pending, not copied into pending_.
    const size_t head = pending_.size() - (kRecordHeader + 1);
    std::string header = pending_.substr(head);  // the record's header, written with it
    pending_.resize(head);
    if (!Flush()) failed_ = true;
    const uint32_t trailer = check;
    iovec iov[4] = {{header.data(), header.size()},
                    {const_cast<char*>(a.data()), a.size()},
                    {const_cast<char*>(b.data()), b.size()},
                    {const_cast<uint32_t*>(&trailer), sizeof(trailer)}};
    if (!PwritevAll(fd_.get(), iov, 4, offset)) failed_ = true;
    end_ = pending_at_ = offset + kRecordHeader + 1 + a.size() + b.size() + kRecordTrailer;
    return;
  }
  pending_.append(a.data(), a.size());
  pending_.append(b.data(), b.size());
  Put<uint32_t>(&pending_, check);
  end_ += kRecordHeader + 1 + a.size() + b.size() + kRecordTrailer;
}

void StateJournal::Init(absl::string_view init_request, uint32_t max_write) {
  std::string a;
  Put(&a, max_write);
  Record('I', a, init_request);
}

void StateJournal::Node(uint64_t kid, const SavedNode& node) {
  std::string a;
  Put(&a, kid);
  Put(&a, node.parent);
  Put(&a, node.kernel_lookups);
  Record('N', a, node.name);
}

void StateJournal::NodeGone(uint64_t kid) { Record('n', absl::string_view(reinterpret_cast<const char*>(&kid), 8)); }

void StateJournal::Handle(uint64_t kfh, const SavedHandle& h) {
  std::string a;
  Put(&a, kfh);
  Put(&a, h.kid);
  Put(&a, h.flags);
  Put<uint8_t>(&a, h.dir ? 1 : 0);
  Put<uint8_t>(&a, h.maybe_lost ? 1 : 0);
  Put<uint64_t>(&a, h.written ? 1 : 0);
  Record('H', a);
}

void StateJournal::HandleGone(uint64_t kfh) { Record('h', absl::string_view(reinterpret_cast<const char*>(&kfh), 8)); }

void StateJournal::Change(uint64_t kid, uint64_t kfh, absl::string_view request, bool durable) {
  std::string a;
  Put(&a, kid);
  Put(&a, kfh);
  Put<uint8_t>(&a, durable ? 1 : 0);
  Record('C', a, request);
}

void StateJournal::Answer(uint64_t unique, absl::string_view reply) {
  std::string a;
  Put(&a, unique);
  Record('A', a, reply);
}

void StateJournal::Unrepeatable(uint64_t kid, uint64_t kfh) {
  std::string a;
  Put(&a, kid);
  Put(&a, kfh);
  Record('U', a);
}

void StateJournal::Synced(uint64_t kid, uint64_t kfh) {
  std::string a;
  Put(&a, kid);
  Put(&a, kfh);
  Record('Y', a);
}

void StateJournal::DropChanges(uint64_t kid) { Record('D', absl::string_view(reinterpret_cast<const char*>(&kid), 8)); }

bool StateJournal::Flush() {
  bool ok = !failed_;
  failed_ = false;
  if (pending_.empty()) return ok;
  ok = PwriteAll(fd_.get(), pending_.data(), pending_.size(), pending_at_) && ok;
  pending_.clear();
  pending_at_ = end_;
  return ok;
}

bool StateJournal::WantsCompaction(uint64_t live_bytes) const {
  return !compacting_ && log_bytes() > 2 * live_bytes + (1u << 20);
}

void StateJournal::BeginCompaction() {
  Flush();
  // At least one zero record header between the old log and the new: a reader of the old log
  // stops there.
  compaction_start_ = RoundUp(end_ + kRecordHeader);
  end_ = pending_at_ = compaction_start_;
  compacting_ = true;
}

bool StateJournal::EndCompaction() {
  compacting_ = false;
  if (!Flush() || !WriteHeader(compaction_start_)) return false;
  const uint64_t old = start_ / kPage * kPage;
  fallocate(fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(old),
            static_cast<off_t>(compaction_start_ - old));
  start_ = compaction_start_;
  return true;
}

}  // namespace fusekeeper::relay
