#include "agent/mount/mountinfo.h"

#include "absl/strings/str_cat.h"

namespace fusekeeper {
namespace {

bool ParseU32(absl::string_view s, uint32_t* out) {
  if (s.empty() || s.size() > 10) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (v > UINT32_MAX) return false;
  *out = static_cast<uint32_t>(v);
  return true;
}

// Splits off the next space-separated field of `rest`. Returns false if none is left.
bool NextField(absl::string_view* rest, absl::string_view* field) {
  if (rest->empty()) return false;
  size_t sp = rest->find(' ');
  if (sp == absl::string_view::npos) {
    *field = *rest;
    *rest = absl::string_view();
  } else {
    *field = rest->substr(0, sp);
    rest->remove_prefix(sp + 1);
  }
  return true;
}

bool IsOctal(char c) { return c >= '0' && c <= '7'; }

}  // namespace

bool MountEntry::read_only() const {
  absl::string_view o = mount_options;
  return o == "ro" || o.substr(0, 3) == "ro,";
}

std::string UnescapeMountField(absl::string_view field) {
  std::string out;
  out.reserve(field.size());
  for (size_t i = 0; i < field.size(); ++i) {
    if (field[i] == '\\' && i + 3 < field.size() && IsOctal(field[i + 1]) &&
        IsOctal(field[i + 2]) && IsOctal(field[i + 3])) {
      out.push_back(static_cast<char>((field[i + 1] - '0') * 64 + (field[i + 2] - '0') * 8 +
                                      (field[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(field[i]);
    }
  }
  return out;
}

std::string EscapeMountField(absl::string_view path) {
  std::string out;
  for (char c : path) {
    switch (c) {
      case ' ': out += "\\040"; break;
      case '\t': out += "\\011"; break;
      case '\n': out += "\\012"; break;
      case '\\': out += "\\134"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

absl::StatusOr<MountTable> MountTable::Parse(std::string text) {
  MountTable table;
  table.text_ = std::make_unique<std::string>(std::move(text));
  table.unescaped_ = std::make_unique<std::deque<std::string>>();
  absl::string_view all(*table.text_);
  table.entries_.reserve(all.size() / 100 + 1);

  auto field_value = [&table](absl::string_view raw) -> absl::string_view {
    if (raw.find('\\') == absl::string_view::npos) return raw;
    table.unescaped_->push_back(UnescapeMountField(raw));
    return table.unescaped_->back();
  };

  int line_no = 0;
  while (!all.empty()) {
    ++line_no;
    size_t nl = all.find('\n');
    absl::string_view line = all.substr(0, nl);
    all.remove_prefix(nl == absl::string_view::npos ? all.size() : nl + 1);
    if (line.empty()) continue;
    auto bad = [&](absl::string_view what) {
      std::string shown(line.substr(0, 200));
      return absl::InvalidArgumentError(
          absl::StrCat("mountinfo line ", line_no, ": ", what, ": \"", shown, "\""));
    };

    MountEntry e;
    absl::string_view rest = line, f;
    if (!NextField(&rest, &f) || !ParseU32(f, &e.id)) return bad("bad mount id");
    if (!NextField(&rest, &f) || !ParseU32(f, &e.parent_id)) return bad("bad parent id");
    if (!NextField(&rest, &f)) return bad("missing major:minor");
    size_t colon = f.find(':');
    if (colon == absl::string_view::npos || !ParseU32(f.substr(0, colon), &e.major) ||
        !ParseU32(f.substr(colon + 1), &e.minor)) {
      return bad("bad major:minor");
    }
    if (!NextField(&rest, &f) || f.empty()) return bad("missing root");
    e.root = field_value(f);
    if (!NextField(&rest, &f) || f.empty()) return bad("missing mount point");
    e.mount_point = field_value(f);
    if (!NextField(&rest, &f) || f.empty()) return bad("missing mount options");
    e.mount_options = f;
    // Optional fields up to the lone "-" separator.
    bool separator = false;
    while (NextField(&rest, &f)) {
      if (f == "-") {
        separator = true;
        break;
      }
      size_t c = f.find(':');
      absl::string_view tag = f.substr(0, c);
      absl::string_view value = c == absl::string_view::npos ? absl::string_view() : f.substr(c + 1);
      uint32_t n = 0;
      if (tag == "shared") {
        if (!ParseU32(value, &n)) return bad("bad shared: tag");
        e.shared = n;
      } else if (tag == "master") {
        if (!ParseU32(value, &n)) return bad("bad master: tag");
        e.master = n;
      } else if (tag == "propagate_from") {
        if (!ParseU32(value, &n)) return bad("bad propagate_from: tag");
        e.propagate_from = n;
      } else if (tag == "unbindable") {
        e.unbindable = true;
      }  // unknown tags: ignored, as proc(5) asks
    }
    if (!separator) return bad("no \" - \" separator");
    if (!NextField(&rest, &f) || f.empty()) return bad("missing file system type");
    e.fs_type = field_value(f);
    // The source may be empty on some file systems ("none" is usual, but an empty field shows as
    // two spaces): take what is there.
    if (!NextField(&rest, &f)) return bad("missing mount source");
    e.source = field_value(f);
    if (!NextField(&rest, &f)) return bad("missing super options");
    e.super_options = f;
    table.entries_.push_back(e);
  }
  return table;
}

std::vector<const MountEntry*> MountTable::FindAll(absl::string_view mount_point) const {
  std::vector<const MountEntry*> out;
  for (const MountEntry& e : entries_) {
    if (e.mount_point == mount_point) out.push_back(&e);
  }
  return out;
}

const MountEntry* MountTable::FindTop(absl::string_view mount_point) const {
  std::vector<const MountEntry*> all = FindAll(mount_point);
  // The top of a stack is the one no other mount at the same point sits on. A namespace's root
  // is its own parent (proc(5)), which does not cover it; a cycle (only in malformed input)
  // falls back to the last entry, the most recent mount.
  for (const MountEntry* candidate : all) {
    bool covered = false;
    for (const MountEntry* other : all) {
      if (other != candidate && other->parent_id == candidate->id) covered = true;
    }
    if (!covered) return candidate;
  }
  return all.empty() ? nullptr : all.back();
}

const MountEntry* MountTable::FindById(uint32_t id) const {
  for (const MountEntry& e : entries_) {
    if (e.id == id) return &e;
  }
  return nullptr;
}

}  // namespace fusekeeper
