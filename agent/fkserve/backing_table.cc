#include "agent/fkserve/backing_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fusekeeper {
namespace {

constexpr char kMagic[8] = {'F', 'K', 'B', 'A', 'C', 'K', '0', '1'};
constexpr size_t kHeaderBytes = 64;
constexpr uint32_t kMaxCapacity = 1u << 22;

struct Header {
  char magic[8];
  uint32_t capacity;
};

}  // namespace

struct BackingTable::Slot {
  uint64_t fh;
  uint64_t nodeid;
  int32_t id;
  uint32_t used;  // written last, cleared first (the class comment)
};

namespace {

size_t BytesFor(uint32_t capacity) { return kHeaderBytes + size_t{capacity} * 24; }

absl::StatusOr<void*> Map(int fd, size_t bytes) {
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap of the backing table: ", strerror(errno)));
  return map;
}

}  // namespace

absl::StatusOr<std::unique_ptr<BackingTable>> BackingTable::Create(uint32_t capacity) {
  static_assert(sizeof(Slot) == 24, "the memfd's layout");
  if (capacity == 0 || capacity > kMaxCapacity) return absl::InvalidArgumentError("backing table capacity out of range");
  UniqueFd fd(memfd_create("fkserve-backing-table", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return absl::InternalError(absl::StrCat("memfd_create: ", strerror(errno)));
  const size_t bytes = BytesFor(capacity);
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::InternalError(absl::StrCat("sizing the backing table: ", strerror(errno)));
  }
  auto map = Map(fd.get(), bytes);
  if (!map.ok()) return map.status();
  Header h{};
  memcpy(h.magic, kMagic, sizeof(kMagic));
  h.capacity = capacity;
  memcpy(*map, &h, sizeof(h));
  return std::unique_ptr<BackingTable>(new BackingTable(std::move(fd), *map, capacity));
}

absl::StatusOr<std::unique_ptr<BackingTable>> BackingTable::Adopt(UniqueFd fd) {
  auto bad = [](const std::string& why) { return absl::InvalidArgumentError(absl::StrCat("not a backing table: ", why)); };
  Header h{};
  struct stat st;
  if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return bad("not a regular file");
  if (pread(fd.get(), &h, sizeof(h), 0) != static_cast<ssize_t>(sizeof(h)) || memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) {
    return bad("no table header");
  }
  if (h.capacity == 0 || h.capacity > kMaxCapacity || static_cast<size_t>(st.st_size) != BytesFor(h.capacity)) {
    return bad(absl::StrCat("size ", st.st_size, " does not fit capacity ", h.capacity));
  }
  const int seals = fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) return bad("it could be shrunk under its users");
  auto map = Map(fd.get(), BytesFor(h.capacity));
  if (!map.ok()) return map.status();
  std::unique_ptr<BackingTable> table(new BackingTable(std::move(fd), *map, h.capacity));
  table->Index();
  return table;
}

BackingTable::BackingTable(UniqueFd fd, void* map, uint32_t capacity)
    : fd_(std::move(fd)),
      map_(map),
      capacity_(capacity),
      slots_(reinterpret_cast<Slot*>(static_cast<char*>(map) + kHeaderBytes)) {}

BackingTable::~BackingTable() { munmap(map_, BytesFor(capacity_)); }

void BackingTable::Index() {
  for (uint32_t i = 0; i < capacity_; ++i) {
    Slot& s = slots_[i];
    if (__atomic_load_n(&s.used, __ATOMIC_ACQUIRE) == 0) continue;
    // Whole slots only (the class comment); one that names no valid id, or a handle twice, is
    // dropped.
    if (s.id < kCached || by_fh_.count(s.fh) != 0) {
      __atomic_store_n(&s.used, 0, __ATOMIC_RELEASE);
      continue;
    }
    by_fh_[s.fh] = i;
    Count(s.nodeid, s.id);
    high_ = i + 1;
  }
  for (uint32_t i = high_; i-- > 0;) {
    if (__atomic_load_n(&slots_[i].used, __ATOMIC_ACQUIRE) == 0) free_.push_back(i);
  }
}

int32_t BackingTable::IdOf(uint64_t nodeid) const {
  auto it = id_of_node_.find(nodeid);
  return it == id_of_node_.end() ? 0 : it->second;
}

bool BackingTable::Add(uint64_t fh, uint64_t nodeid, int32_t id) {
  if (id < kCached || by_fh_.count(fh) != 0) return false;
  uint32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else if (high_ < capacity_) {
    i = high_++;
  } else {
    return false;
  }
  Slot& s = slots_[i];
  s.fh = fh;
  s.nodeid = nodeid;
  s.id = id;
  __atomic_store_n(&s.used, 1, __ATOMIC_RELEASE);
  by_fh_[fh] = i;
  Count(nodeid, id);
  return true;
}

void BackingTable::Count(uint64_t nodeid, int32_t id) {
  if (id == kCached) {
    ++cached_of_node_[nodeid];
    return;
  }
  id_of_node_.emplace(nodeid, id);
  ++handles_of_id_[id];
}

int32_t BackingTable::Remove(uint64_t fh) {
  auto it = by_fh_.find(fh);
  if (it == by_fh_.end()) return 0;
  Slot& s = slots_[it->second];
  __atomic_store_n(&s.used, 0, __ATOMIC_RELEASE);
  free_.push_back(it->second);
  by_fh_.erase(it);
  const int32_t id = s.id;
  if (id == kCached) {
    auto cached = cached_of_node_.find(s.nodeid);
    if (cached != cached_of_node_.end() && --cached->second == 0) cached_of_node_.erase(cached);
    return 0;
  }
  auto count = handles_of_id_.find(id);
  if (count == handles_of_id_.end() || --count->second > 0) return 0;
  handles_of_id_.erase(count);
  if (auto node = id_of_node_.find(s.nodeid); node != id_of_node_.end() && node->second == id) id_of_node_.erase(node);
  return id;
}

}  // namespace fusekeeper
