// Parsing /proc/<pid>/mountinfo (proc(5)):
//
//   36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
//   (1)(2)(3)   (4)   (5)      (6)      (7)   (8) (9)     (10)         (11)
//
// Fields are views into one buffer owned by the MountTable, so a parse costs one pass and no
// per-field allocation; only fields containing octal escapes (\040 space, \011 tab, \012 newline,
// \134 backslash) are unescaped into side storage. Garbage or truncated lines give an error that
// names the line; nothing here can crash on bad input.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fusekeeper {

struct MountEntry {
  uint32_t id = 0;         // (1) unique per namespace while mounted (may be reused later)
  uint32_t parent_id = 0;  // (2)
  uint32_t major = 0;      // (3)
  uint32_t minor = 0;
  absl::string_view root;           // (4) path within the file system that is mounted
  absl::string_view mount_point;    // (5) relative to the process root
  absl::string_view mount_options;  // (6) per-mount options: rw/ro, nosuid, nodev, ...
  // (7) optional tags; 0 = absent. Unknown tags are ignored.
  uint32_t shared = 0;          // shared:N  (peer group N)
  uint32_t master = 0;          // master:N  (slave of peer group N)
  uint32_t propagate_from = 0;  // propagate_from:N
  bool unbindable = false;
  absl::string_view fs_type;        // (9)
  absl::string_view source;         // (10)
  absl::string_view super_options;  // (11)

  bool read_only() const;  // per-mount "ro"
};

class MountTable {
 public:
  // Parses a whole mountinfo text. An error names the 1-based line and what is wrong with it.
  static absl::StatusOr<MountTable> Parse(std::string text);

  MountTable(MountTable&&) = default;
  MountTable& operator=(MountTable&&) = default;

  const std::vector<MountEntry>& entries() const { return entries_; }

  // All mounts whose mount point is exactly `path`, in table order (bottom first).
  std::vector<const MountEntry*> FindAll(absl::string_view mount_point) const;
  // The mount visible at `path` (the top of any stack), or nullptr if nothing is mounted there.
  const MountEntry* FindTop(absl::string_view mount_point) const;
  const MountEntry* FindById(uint32_t id) const;

 private:
  MountTable() = default;
  // Heap-held so the views stay valid when the table moves.
  std::unique_ptr<std::string> text_;
  std::unique_ptr<std::deque<std::string>> unescaped_;
  std::vector<MountEntry> entries_;
};

// Decodes mountinfo's octal escapes (\NNN); other backslashes are kept literally.
std::string UnescapeMountField(absl::string_view field);
// The inverse, for comparing a path we hold with a raw field or for tests.
std::string EscapeMountField(absl::string_view path);

}  // namespace fusekeeper
