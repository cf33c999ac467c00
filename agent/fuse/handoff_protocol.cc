#include "agent/fuse/handoff_protocol.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "agent/base/json.h"
#include "agent/base/status.h"
#include "simdjson.h"

namespace fusekeeper {
namespace {

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("handoff message: ", what));
}

void AppendMap(std::string* out, const char* key, const std::map<std::string, std::string>& m) {
  absl::StrAppend(out, ",\"", key, "\":{");
  bool first = true;
  for (const auto& [k, v] : m) {
    absl::StrAppend(out, first ? "" : ",", JsonQuote(k), ":", JsonQuote(v));
    first = false;
  }
  out->push_back('}');
}

absl::StatusOr<simdjson::dom::element> ParseObject(simdjson::dom::parser& parser, absl::string_view json) {
  if (json.size() > kMaxHandoffMessageBytes) {
    return Bad(absl::StrCat(json.size(), " bytes is more than the ", kMaxHandoffMessageBytes, " allowed"));
  }
  simdjson::dom::element doc;
  auto error = parser.parse(json.data(), json.size()).get(doc);
  if (error) return Bad(absl::StrCat("not valid JSON (", simdjson::error_message(error), ")"));
  if (!doc.is_object()) return Bad("not a JSON object");
  int64_t version = 0;
  if (doc["version"].get_int64().get(version)) return Bad("\"version\" missing or not an integer");
  if (version != kHandoffProtocolVersion) {
    return Bad(absl::StrCat("protocol version ", version, " is not supported (this side speaks ",
                            kHandoffProtocolVersion, ")"));
  }
  return doc;
}

absl::Status ReadStringMap(simdjson::dom::element doc, const char* key,
                           std::map<std::string, std::string>* out) {
  simdjson::dom::element e;
  if (doc[key].get(e)) return absl::OkStatus();  // optional
  simdjson::dom::object obj;
  if (e.get_object().get(obj)) return Bad(absl::StrCat("\"", key, "\" is not an object"));
  for (auto field : obj) {
    std::string_view v;
    if (field.value.get_string().get(v)) {
      return Bad(absl::StrCat("\"", key, "\" value for \"", std::string(field.key), "\" is not a string"));
    }
    (*out)[std::string(field.key)] = std::string(v);
  }
  return absl::OkStatus();
}

}  // namespace

std::string EncodeHex(absl::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

absl::StatusOr<std::string> DecodeHex(absl::string_view hex) {
  if (hex.size() % 2 != 0) return absl::InvalidArgumentError("hex string of odd length");
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return absl::InvalidArgumentError("not a hex string");
    out.push_back(static_cast<char>(hi << 4 | lo));
  }
  return out;
}

std::string EncodeMountConfig(const MountConfig& c) {
  std::string out = absl::StrCat("{\"version\":", c.version, ",\"volume_id\":", JsonQuote(c.volume_id),
                                 ",\"read_only\":", c.read_only ? "true" : "false", ",\"uid\":", c.uid,
                                 ",\"gid\":", c.gid);
  if (c.mount_group) absl::StrAppend(&out, ",\"mount_group\":", *c.mount_group);
  out += ",\"mount_options\":[";
  for (size_t i = 0; i < c.mount_options.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", JsonQuote(c.mount_options[i]));
  }
  out += "]";
  AppendMap(&out, "volume_context", c.volume_context);
  AppendMap(&out, "secrets", c.secrets);
  if (c.live) absl::StrAppend(&out, ",\"live\":true,\"init\":\"", EncodeHex(c.init), "\"");
  if (c.live && c.relay_state) out += ",\"relay_state\":true";
  if (c.drain_ms > 0) absl::StrAppend(&out, ",\"drain_ms\":", c.drain_ms);
  out += "}";
  return out;
}

std::string EncodeHandoffRefusal(absl::string_view error) {
  return absl::StrCat("{\"version\":", kHandoffProtocolVersion, ",\"error\":", JsonQuote(error), "}");
}

absl::StatusOr<MountConfig> DecodeMountConfig(absl::string_view json) {
  simdjson::dom::parser parser;
  auto doc = ParseObject(parser, json);
  if (!doc.ok()) return doc.status();
  MountConfig c;
  std::string_view id;
  std::string_view refusal;
  if (!(*doc)["error"].get_string().get(refusal)) {
    return absl::FailedPreconditionError(absl::StrCat("the agent refused the handoff: ", std::string(refusal)));
  }
  if ((*doc)["volume_id"].get_string().get(id) || id.empty()) {
    return Bad("\"volume_id\" missing or not a non-empty string");
  }
  c.volume_id = std::string(id);
  simdjson::dom::element e;
  if (!(*doc)["read_only"].get(e)) {
    if (e.get_bool().get(c.read_only)) return Bad("\"read_only\" is not a boolean");
  }
  for (auto [key, dst] : {std::pair<const char*, uint32_t*>{"uid", &c.uid}, {"gid", &c.gid}}) {
    if ((*doc)[key].get(e)) continue;
    uint64_t v;
    if (e.get_uint64().get(v) || v > UINT32_MAX) return Bad(absl::StrCat("\"", key, "\" is not a 32-bit unsigned integer"));
    *dst = static_cast<uint32_t>(v);
  }
  if (!(*doc)["mount_group"].get(e)) {
    uint64_t v;
    if (e.get_uint64().get(v) || v > UINT32_MAX) return Bad("\"mount_group\" is not a 32-bit unsigned integer");
    c.mount_group = static_cast<uint32_t>(v);
  }
  if (!(*doc)["mount_options"].get(e)) {
    simdjson::dom::array arr;
    if (e.get_array().get(arr)) return Bad("\"mount_options\" is not an array");
    for (auto item : arr) {
      std::string_view v;
      if (item.get_string().get(v)) return Bad("\"mount_options\" holds a non-string");
      c.mount_options.emplace_back(v);
    }
  }
  if (auto s = ReadStringMap(*doc, "volume_context", &c.volume_context); !s.ok()) return s;
  if (auto s = ReadStringMap(*doc, "secrets", &c.secrets); !s.ok()) return s;
  if (!(*doc)["live"].get(e)) {
    if (e.get_bool().get(c.live)) return Bad("\"live\" is not a boolean");
  }
  if (c.live) {
    std::string_view hex;
    if ((*doc)["init"].get_string().get(hex)) return Bad("\"live\" without an \"init\" string");
    auto raw = DecodeHex(absl::string_view(hex.data(), hex.size()));
    if (!raw.ok()) return Bad(absl::StrCat("\"init\": ", raw.status().message()));
    c.init = std::move(*raw);
    if (!(*doc)["relay_state"].get(e)) {
      if (e.get_bool().get(c.relay_state)) return Bad("\"relay_state\" is not a boolean");
    }
  }
  if (!(*doc)["drain_ms"].get(e)) {
    if (e.get_int64().get(c.drain_ms) || c.drain_ms < 0) return Bad("\"drain_ms\" is not a duration in ms");
  }
  return c;
}

std::string EncodeHandoffReply(const HandoffReply& r) {
  std::string out = absl::StrCat("{\"version\":", r.version, ",\"ok\":", r.ok ? "true" : "false");
  if (!r.error.empty()) absl::StrAppend(&out, ",\"error\":", JsonQuote(r.error));
  if (!r.server.empty()) absl::StrAppend(&out, ",\"server\":", JsonQuote(r.server));
  if (r.fresh) out += ",\"fresh\":true";
  if (r.redeposit) out += ",\"redeposit\":true";
  if (!r.notice.empty()) absl::StrAppend(&out, ",\"notice\":", JsonQuote(r.notice));
  if (r.relayed) out += ",\"relayed\":true";
  if (r.restart_ms >= 0) absl::StrAppend(&out, ",\"restart_ms\":", r.restart_ms);
  if (r.relay_state) out += ",\"relay_state\":true";
  if (r.draining) out += ",\"draining\":true";
  if (!r.init.empty()) absl::StrAppend(&out, ",\"init\":\"", EncodeHex(r.init), "\"");
  out += "}";
  return out;
}

absl::StatusOr<HandoffReply> DecodeHandoffReply(absl::string_view json) {
  simdjson::dom::parser parser;
  auto doc = ParseObject(parser, json);
  if (!doc.ok()) return doc.status();
  HandoffReply r;
  if ((*doc)["ok"].get_bool().get(r.ok)) return Bad("\"ok\" missing or not a boolean");
  std::string_view v;
  if (!(*doc)["error"].get_string().get(v)) r.error = std::string(v);
  if (!(*doc)["server"].get_string().get(v)) r.server = std::string(v);
  if (!(*doc)["notice"].get_string().get(v)) r.notice = std::string(v.substr(0, 1024));
  simdjson::dom::element e;
  if (!(*doc)["fresh"].get(e)) {
    if (e.get_bool().get(r.fresh)) return Bad("\"fresh\" is not a boolean");
  }
  if (!(*doc)["redeposit"].get(e)) {
    if (e.get_bool().get(r.redeposit)) return Bad("\"redeposit\" is not a boolean");
  }
  if (!(*doc)["relayed"].get(e)) {
    if (e.get_bool().get(r.relayed)) return Bad("\"relayed\" is not a boolean");
  }
  if (!(*doc)["relay_state"].get(e)) {
    if (e.get_bool().get(r.relay_state)) return Bad("\"relay_state\" is not a boolean");
  }
  if (!(*doc)["restart_ms"].get(e)) {
    if (e.get_int64().get(r.restart_ms) || r.restart_ms < 0) return Bad("\"restart_ms\" is not a duration in ms");
  }
  if (!(*doc)["draining"].get(e)) {
    if (e.get_bool().get(r.draining)) return Bad("\"draining\" is not a boolean");
  }
  if (!(*doc)["init"].get_string().get(v)) {
    auto raw = DecodeHex(absl::string_view(v.data(), v.size()));
    if (!raw.ok()) return Bad(absl::StrCat("\"init\": ", raw.status().message()));
    if (raw->size() > 4096) return Bad("\"init\" is larger than any FUSE_INIT request");
    r.init = std::move(*raw);
  }
  if (!r.ok && r.error.empty()) r.error = "the server refused the volume without saying why";
  return r;
}

absl::Status SendHandoffMessage(int sock, absl::string_view payload, int fd, int fd2) {
  if (payload.size() > kMaxHandoffMessageBytes) return Bad("payload too large to send");
  const int fds[2] = {fd, fd2};
  const ssize_t n = SendWithFds(sock, payload.data(), payload.size(), fds, 2);
  if (n < 0) return ErrnoStatus(errno, "sending handoff message");
  if (static_cast<size_t>(n) != payload.size()) return absl::InternalError("short handoff send");
  return absl::OkStatus();
}

absl::StatusOr<ReceivedMessage> ReceiveHandoffMessage(int sock) {
  std::string buf(kMaxHandoffMessageBytes + 1, '\0');
  // Every fd is owned first, so that nothing leaks whatever is wrong below.
  std::vector<UniqueFd> fds;
  int flags = 0;
  bool other_control = false;
  const ssize_t n = ReceiveWithFds(sock, buf.data(), buf.size(), &fds, &flags, &other_control);
  if (n < 0) return ErrnoStatus(errno, "receiving handoff message");
  if (n == 0 && fds.empty()) return absl::UnavailableError("the peer closed the handoff socket");
  if (flags & (MSG_TRUNC | MSG_CTRUNC)) return Bad("message or its control data was truncated");
  if (other_control) return Bad("unexpected control data");
  if (fds.size() > 2) return Bad(absl::StrCat(fds.size(), " file descriptors attached; expected at most 2"));
  ReceivedMessage out;
  out.payload.assign(buf.data(), static_cast<size_t>(n));
  if (!fds.empty()) out.fd = std::move(fds[0]);
  if (fds.size() > 1) out.fd2 = std::move(fds[1]);
  return out;
}

bool IsMemfd(int fd) {
  // Only shmem files answer F_GET_SEALS (a memfd made without sealing says F_SEAL_SEAL), and a
  // memfd's name is "/memfd:<name>" (not a file on any file system the agent could be led to).
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || fcntl(fd, F_GET_SEALS) < 0) return false;
  char link[64];
  const ssize_t n = readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), link, sizeof(link) - 1);
  return n > 7 && memcmp(link, "/memfd:", 7) == 0;
}

bool IsFinalBackingRefusal(absl::string_view error) {
  return absl::StrContains(error, kRefusalNoBroker) || absl::StrContains(error, kRefusalNotNegotiated);
}

std::string EncodeBackingRequest(const BackingRequest& r) {
  if (r.open) return absl::StrCat("{\"version\":", kHandoffProtocolVersion, ",\"backing_open\":", r.id, "}");
  return absl::StrCat("{\"version\":", kHandoffProtocolVersion, ",\"backing_close\":", r.backing_id, ",\"id\":", r.id,
                      "}");
}

absl::StatusOr<std::optional<BackingRequest>> DecodeBackingRequest(absl::string_view json) {
  simdjson::dom::parser parser;
  auto doc = ParseObject(parser, json);
  if (!doc.ok()) return std::optional<BackingRequest>();
  BackingRequest r;
  simdjson::dom::element e;
  if (!(*doc)["backing_open"].get(e)) {
    if (e.get_uint64().get(r.id)) return Bad("\"backing_open\" is not a request id");
    r.open = true;
    return std::optional<BackingRequest>(r);
  }
  if ((*doc)["backing_close"].get(e)) return std::optional<BackingRequest>();
  int64_t id = 0;
  if (e.get_int64().get(id) || id <= 0 || id > INT32_MAX) return Bad("\"backing_close\" is not a backing id");
  r.backing_id = static_cast<int32_t>(id);
  if ((*doc)["id"].get_uint64().get(r.id)) return Bad("\"id\" missing or not a request id");
  return std::optional<BackingRequest>(r);
}

std::string EncodeBackingReply(const BackingReply& r) {
  if (!r.error.empty()) {
    return absl::StrCat("{\"version\":", kHandoffProtocolVersion, ",\"backing_reply\":", r.id,
                        ",\"error\":", JsonQuote(r.error), "}");
  }
  return absl::StrCat("{\"version\":", kHandoffProtocolVersion, ",\"backing_reply\":", r.id,
                      ",\"backing_id\":", r.backing_id, "}");
}

absl::StatusOr<std::optional<BackingReply>> DecodeBackingReply(absl::string_view json) {
  simdjson::dom::parser parser;
  auto doc = ParseObject(parser, json);
  if (!doc.ok()) return std::optional<BackingReply>();
  BackingReply r;
  simdjson::dom::element e;
  if ((*doc)["backing_reply"].get(e)) return std::optional<BackingReply>();
  if (e.get_uint64().get(r.id)) return Bad("\"backing_reply\" is not a request id");
  std::string_view v;
  if (!(*doc)["error"].get_string().get(v)) {
    r.error = std::string(v.substr(0, 1024));
    if (r.error.empty()) r.error = "refused without a reason";
    return std::optional<BackingReply>(r);
  }
  int64_t id = 0;
  if ((*doc)["backing_id"].get_int64().get(id) || id < 0 || id > INT32_MAX) return Bad("\"backing_id\" is not a backing id");
  r.backing_id = static_cast<int32_t>(id);
  return std::optional<BackingReply>(r);
}

std::string EncodeStopRequest() { return absl::StrCat("{\"version\":", kHandoffProtocolVersion, ",\"stop\":true}"); }

bool IsStopRequest(absl::string_view json) {
  simdjson::dom::parser parser;
  auto doc = ParseObject(parser, json);
  if (!doc.ok()) return false;
  bool stop = false;
  return !(*doc)["stop"].get_bool().get(stop) && stop;
}

}  // namespace fusekeeper
