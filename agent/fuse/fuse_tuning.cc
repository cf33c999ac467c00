#include "agent/fuse/fuse_tuning.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "agent/base/status.h"
#include "agent/base/unique_fd.h"
#include "agent/fuse/fuse_mount.h"

namespace fusekeeper {
namespace {

constexpr char kReadAheadKb[] = "readAheadKb";
constexpr char kMaxBackground[] = "maxBackground";
constexpr char kCongestionThreshold[] = "congestionThreshold";

absl::StatusOr<uint32_t> Bounded(const std::string& key, const std::string& value, uint32_t min, uint32_t max) {
  uint32_t v = 0;
  if (value.empty() || value.find_first_not_of("0123456789") != std::string::npos || !absl::SimpleAtoi(value, &v) ||
      v < min || v > max) {
    return absl::InvalidArgumentError(absl::StrCat("volume_context.", key, " '", value, "' is not a whole number from ",
                                                   min, " to ", max));
  }
  return v;
}

std::string BdiReadAheadPath(uint32_t dev_minor) {
  return absl::StrCat("/sys/class/bdi/0:", dev_minor, "/read_ahead_kb");
}

absl::Status WriteNumber(const std::string& path, uint32_t value) {
  UniqueFd fd(open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) return ErrnoStatus(errno, "open", path);
  const std::string text = absl::StrCat(value, "\n");
  if (write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    return ErrnoStatus(errno, absl::StrCat("writing ", value, " to"), path);
  }
  return absl::OkStatus();
}

int64_t ReadNumber(const std::string& path) {
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return -1;
  char buf[32];
  const ssize_t n = read(fd.get(), buf, sizeof(buf) - 1);
  if (n <= 0) return -1;
  buf[n] = '\0';
  int64_t v = -1;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(buf), &v) ? v : -1;
}

}  // namespace

bool IsFuseTuningKey(const std::string& key) {
  return key == kReadAheadKb || key == kMaxBackground || key == kCongestionThreshold;
}

absl::Status ParseFuseTuning(const google::protobuf::Map<std::string, std::string>& ctx, state::Fuse* fuse) {
  if (auto it = ctx.find(kReadAheadKb); it != ctx.end()) {
    auto v = Bounded(kReadAheadKb, it->second, 0, 1 << 20);
    if (!v.ok()) return v.status();
    fuse->set_read_ahead_kb(*v);
  }
  if (auto it = ctx.find(kMaxBackground); it != ctx.end()) {
    auto v = Bounded(kMaxBackground, it->second, 1, 65535);
    if (!v.ok()) return v.status();
    fuse->set_max_background(*v);
  }
  if (auto it = ctx.find(kCongestionThreshold); it != ctx.end()) {
    auto v = Bounded(kCongestionThreshold, it->second, 1, 65535);
    if (!v.ok()) return v.status();
    fuse->set_congestion_threshold(*v);
  }
  return absl::OkStatus();
}

bool HasFuseTuning(const state::Fuse& f) {
  return f.has_read_ahead_kb() || f.has_max_background() || f.has_congestion_threshold();
}

absl::Status ApplyFuseTuningBlocking(uint32_t dev_minor, const state::Fuse& f) {
  if (f.has_max_background() || f.has_congestion_threshold()) {
    auto dir = OpenFuseConnectionDirBlocking(dev_minor);
    if (!dir.ok()) return dir.status();
    if (f.has_max_background()) {
      if (auto s = WriteNumber(*dir + "/max_background", f.max_background()); !s.ok()) return s;
    }
    if (f.has_congestion_threshold()) {
      if (auto s = WriteNumber(*dir + "/congestion_threshold", f.congestion_threshold()); !s.ok()) return s;
    }
  }
  if (f.has_read_ahead_kb()) {
    if (auto s = WriteNumber(BdiReadAheadPath(dev_minor), f.read_ahead_kb()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

FuseTuningNow ReadFuseTuningBlocking(uint32_t dev_minor) {
  FuseTuningNow now;
  const std::string dir = FuseConnectionDir(dev_minor);
  now.max_background = ReadNumber(dir + "/max_background");
  now.congestion_threshold = ReadNumber(dir + "/congestion_threshold");
  now.read_ahead_kb = ReadNumber(BdiReadAheadPath(dev_minor));
  return now;
}

std::string DescribeFuseTuning(const state::Fuse& f) {
  std::string out;
  auto add = [&out](const char* key, uint32_t v) { absl::StrAppend(&out, out.empty() ? "" : " ", key, "=", v); };
  if (f.has_read_ahead_kb()) add(kReadAheadKb, f.read_ahead_kb());
  if (f.has_max_background()) add(kMaxBackground, f.max_background());
  if (f.has_congestion_threshold()) add(kCongestionThreshold, f.congestion_threshold());
  return out;
}

}  // namespace fusekeeper
