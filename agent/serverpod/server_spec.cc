#include "agent/serverpod/server_spec.h"

#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/base/sha256.h"
#include "simdjson.h"

namespace fusekeeper {
namespace {

constexpr char kImage[] = "serverImage";
constexpr char kCommand[] = "serverCommand";
constexpr char kArgs[] = "serverArgs";
constexpr char kResources[] = "serverResources";
constexpr size_t kMaxImage = 512;
constexpr size_t kMaxArgs = 256;
constexpr size_t kMaxArg = 4096;
constexpr size_t kMaxJson = 64 << 10;

absl::Status Bad(absl::string_view key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("volume_context.", key, " ", what));
}

const std::string* Find(const google::protobuf::Map<std::string, std::string>& ctx, const char* key) {
  auto it = ctx.find(key);
  return it == ctx.end() ? nullptr : &it->second;
}

absl::Status CheckImage(const std::string& image) {
  if (auto s = CheckServerImage(image, "volume_context.serverImage"); !s.ok()) {
    return absl::InvalidArgumentError(s.message());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckServerImage(const std::string& image, const std::string& what) {
  auto Bad = [&what](absl::string_view why) { return absl::InvalidArgumentError(absl::StrCat(what, " ", why)); };
  if (image.empty()) return Bad("is empty");
  if (image.size() > kMaxImage) return Bad(absl::StrCat("is longer than ", kMaxImage, " characters"));
  for (unsigned char c : image) {
    if (c <= ' ' || c >= 0x7f) return Bad(absl::StrCat("'", image, "' contains a space or control character"));
  }
  // A tag is a ':' after the last '/' (a registry's port comes before it); a digest is '@'.
  const size_t slash = image.rfind('/');
  const std::string_view last = std::string_view(image).substr(slash == std::string::npos ? 0 : slash + 1);
  const size_t at = image.find('@');
  if (at != std::string::npos) {
    const std::string_view digest = std::string_view(image).substr(at + 1);
    if (digest.substr(0, 7) != "sha256:" || digest.size() != 7 + 64) {
      return Bad(absl::StrCat("'", image, "' has a digest that is not sha256:<64 hex digits>"));
    }
    return absl::OkStatus();
  }
  const size_t colon = last.find(':');
  if (colon == std::string_view::npos || colon + 1 == last.size()) {
    return Bad(absl::StrCat("'", image, "' names no tag or digest: give one (e.g. '", image,
                            ":1.2.3' or '@sha256:…'), so that every node runs the same server and a "
                            "change of it is a deliberate roll"));
  }
  if (last.substr(colon + 1) == "latest") {
    return Bad(absl::StrCat("'", image, "' uses the tag 'latest', which names no fixed image: give a "
                            "version or a digest"));
  }
  return absl::OkStatus();
}

namespace {

absl::Status ParseStrings(const google::protobuf::Map<std::string, std::string>& ctx, const char* key,
                          google::protobuf::RepeatedPtrField<std::string>* out) {
  const std::string* json = Find(ctx, key);
  if (json == nullptr) return absl::OkStatus();
  if (json->size() > kMaxJson) return Bad(key, absl::StrCat("is longer than ", kMaxJson, " bytes"));
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (parser.parse(json->data(), json->size()).get(doc)) {
    return Bad(key, R"(is not valid JSON: give a JSON array of strings, e.g. ["--socket={socket}", "serve"])");
  }
  simdjson::dom::array arr;
  if (doc.get_array().get(arr)) {
    return Bad(key, R"(is not a JSON array: give a JSON array of strings, e.g. ["--socket={socket}", "serve"])");
  }
  size_t i = 0;
  for (simdjson::dom::element e : arr) {
    std::string_view s;
    if (e.get_string().get(s)) return Bad(key, absl::StrCat("element #", i + 1, " is not a string"));
    if (s.size() > kMaxArg) return Bad(key, absl::StrCat("element #", i + 1, " is longer than ", kMaxArg, " bytes"));
    if (s.find('\0') != std::string_view::npos) return Bad(key, absl::StrCat("element #", i + 1, " contains a NUL"));
    if (++i > kMaxArgs) return Bad(key, absl::StrCat("has more than ", kMaxArgs, " elements"));
    out->Add(std::string(s));
  }
  return absl::OkStatus();
}

absl::Status ParseResources(const google::protobuf::Map<std::string, std::string>& ctx, state::ServerPod* pod) {
  const std::string* json = Find(ctx, kResources);
  if (json == nullptr) return absl::OkStatus();
  if (json->size() > kMaxJson) return Bad(kResources, absl::StrCat("is longer than ", kMaxJson, " bytes"));
  static const char kShape[] = R"(: give {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}})";
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (parser.parse(json->data(), json->size()).get(doc)) return Bad(kResources, absl::StrCat("is not valid JSON", kShape));
  simdjson::dom::object obj;
  if (doc.get_object().get(obj)) return Bad(kResources, absl::StrCat("is not a JSON object", kShape));
  for (auto [section_view, value] : obj) {
    const std::string section(section_view);
    google::protobuf::Map<std::string, std::string>* out;
    if (section == "requests") {
      out = pod->mutable_requests();
    } else if (section == "limits") {
      out = pod->mutable_limits();
    } else {
      return Bad(kResources, absl::StrCat("has '", section, "'; only \"requests\" and \"limits\" are read"));
    }
    simdjson::dom::object list;
    if (value.get_object().get(list)) return Bad(kResources, absl::StrCat(section, " is not an object", kShape));
    for (auto [name_view, q] : list) {
      const std::string name(name_view);
      if (name != "cpu" && name != "memory" && name != "ephemeral-storage") {
        return Bad(kResources, absl::StrCat(section, " names '", name, "'; cpu, memory and ephemeral-storage are read"));
      }
      std::string_view quantity;
      if (q.get_string().get(quantity)) {
        return Bad(kResources, absl::StrCat(section, ".", name, " is not a string (write quantities quoted, e.g. \"50m\")"));
      }
      if (auto s = CheckQuantity(std::string(quantity), absl::StrCat("volume_context.", kResources, " ", section, ".", name));
          !s.ok()) {
        return s;
      }
      (*out)[name] = std::string(quantity);
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool IsServerPodKey(const std::string& key) {
  return key == kImage || key == kCommand || key == kArgs || key == kResources;
}

bool DeclaresServerPod(const google::protobuf::Map<std::string, std::string>& ctx) {
  return Find(ctx, kImage) != nullptr;
}

absl::Status CheckQuantity(const std::string& value, const std::string& what) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  if (value[0] == '-') return absl::InvalidArgumentError(absl::StrCat(what, " '", value, "' is negative"));
  if (value.size() > 32) return absl::InvalidArgumentError(absl::StrCat(what, " '", value, "' is too long"));
  size_t i = 0;
  if (value[i] == '+') ++i;
  size_t digits = 0;
  while (i < value.size() && value[i] >= '0' && value[i] <= '9') ++i, ++digits;
  if (i < value.size() && value[i] == '.') {
    ++i;
    while (i < value.size() && value[i] >= '0' && value[i] <= '9') ++i, ++digits;
  }
  static const char* const kSuffixes[] = {"", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"};
  const std::string suffix = value.substr(i);
  bool known = false;
  for (const char* s : kSuffixes) known = known || suffix == s;
  if (digits == 0 || !known) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", value, "' is not a quantity (e.g. 50m, 0.5, 64Mi, 1G)"));
  }
  return absl::OkStatus();
}

absl::Status ParseServerPod(const google::protobuf::Map<std::string, std::string>& ctx, bool has_uid, uint32_t uid,
                            uint32_t gid, state::ServerPod* pod) {
  pod->Clear();
  const std::string* image = Find(ctx, kImage);
  if (image == nullptr) {
    for (const char* key : {kCommand, kArgs, kResources}) {
      if (Find(ctx, key) != nullptr) return Bad(key, "is given without serverImage, the server pod it would configure");
    }
    return absl::OkStatus();
  }
  if (auto s = CheckImage(*image); !s.ok()) return s;
  pod->set_image(*image);
  if (!has_uid) {
    return absl::InvalidArgumentError(
        "volume_context.serverUid is required with serverImage: the server pod runs as that user (not root)");
  }
  if (uid == 0) {
    return absl::InvalidArgumentError(
        "volume_context.serverUid is 0: a server pod runs unprivileged, as a non-root user; give its uid");
  }
  if (gid == 0) {
    return absl::InvalidArgumentError(
        "volume_context.serverGid is 0: a server pod runs unprivileged, outside the root group; give its gid");
  }
  if (auto s = ParseStrings(ctx, kCommand, pod->mutable_command()); !s.ok()) return s;
  if (auto s = ParseStrings(ctx, kArgs, pod->mutable_args()); !s.ok()) return s;
  return ParseResources(ctx, pod);
}

absl::StatusOr<int> ParseRolloutPercent(const std::string& value, const std::string& what) {
  std::string_view v = value;
  if (!v.empty() && v.back() == '%') v.remove_suffix(1);
  int n = 0;
  bool digits = !v.empty() && v.size() <= 3;
  for (char c : v) {
    if (c < '0' || c > '9') digits = false;
    if (digits) n = n * 10 + (c - '0');
  }
  if (!digits || n > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", value.substr(0, 64), "' is not a share of nodes from 0% to 100% (e.g. '25%')"));
  }
  return n;
}

int RolloutBucket(const std::string& volume_id, const std::string& node) {
  const std::string h = Sha256Hex(absl::StrCat(volume_id, "\n", node));
  return static_cast<int>(std::stoul(h.substr(0, 8), nullptr, 16) % 100);
}

}  // namespace fusekeeper
