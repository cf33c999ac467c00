#include "agent/serverpod/api_objects.h"

#include "absl/strings/str_cat.h"
#include "agent/serverpod/pod_manifest.h"
#include "simdjson.h"

namespace fusekeeper {
namespace {

std::string Str(simdjson::dom::element e, const char* pointer) {
  std::string_view v;
  if (e.at_pointer(pointer).get_string().get(v)) return "";
  return std::string(v);
}

// A JSON pointer to `key` under `prefix`: '/' in a key is written "~1" (RFC 6901).
std::string Pointer(const char* prefix, const char* key) {
  std::string out = prefix;
  for (const char* c = key; *c; ++c) {
    if (*c == '~') {
      out += "~0";
    } else if (*c == '/') {
      out += "~1";
    } else {
      out.push_back(*c);
    }
  }
  return out;
}

}  // namespace

std::string ApiMessage(const std::string& body) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (parser.parse(body).get(doc) || !doc.is_object()) return "";
  std::string m = Str(doc, "/message");
  if (m.size() > 400) m = m.substr(0, 400) + "…";
  return m;
}

absl::StatusOr<std::vector<ListedServerPod>> ParseServerPodList(absl::string_view json) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (parser.parse(json.data(), json.size()).get(doc) || !doc.is_object()) {
    return absl::InvalidArgumentError("the pod list is not a JSON object");
  }
  simdjson::dom::array items;
  simdjson::dom::element e;
  if (doc["items"].get(e) || e.is_null()) return std::vector<ListedServerPod>{};
  if (e.get_array().get(items)) return absl::InvalidArgumentError("the pod list's items is not an array");
  std::vector<ListedServerPod> out;
  for (simdjson::dom::element item : items) {
    if (!item.is_object()) return absl::InvalidArgumentError("the pod list holds a non-object");
    ListedServerPod p;
    p.name = Str(item, "/metadata/name");
    p.uid = Str(item, "/metadata/uid");
    p.phase = Str(item, "/status/phase");
    p.volume_id = Str(item, Pointer("/metadata/annotations/", kVolumeAnnotation).c_str());
    p.volume_label = Str(item, Pointer("/metadata/labels/", kVolumeLabel).c_str());
    p.spec_hash = Str(item, Pointer("/metadata/labels/", kSpecLabel).c_str());
    p.node = Str(item, Pointer("/metadata/annotations/", kNodeAnnotation).c_str());
    simdjson::dom::array containers;
    if (!item.at_pointer("/spec/containers").get_array().get(containers)) {
      for (simdjson::dom::element c : containers) {
        if (Str(c, "/name") == kServerContainer) p.image = Str(c, "/image");
      }
    }
    simdjson::dom::array statuses;
    if (!item.at_pointer("/status/containerStatuses").get_array().get(statuses)) {
      for (simdjson::dom::element c : statuses) {
        bool ready = false;
        if (Str(c, "/name") == kServerContainer && !c.at_pointer("/ready").get_bool().get(ready)) p.ready = ready;
      }
    }
    simdjson::dom::element ts;
    p.terminating = !item.at_pointer("/metadata/deletionTimestamp").get(ts) && !ts.is_null();
    if (p.name.empty() || p.uid.empty()) return absl::InvalidArgumentError("a pod in the list has no name or uid");
    out.push_back(std::move(p));
  }
  return out;
}

absl::StatusOr<std::vector<ListedVolume>> ParseVolumeList(absl::string_view json, const std::string& driver) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (parser.parse(json.data(), json.size()).get(doc) || !doc.is_object()) {
    return absl::InvalidArgumentError("the PersistentVolume list is not a JSON object");
  }
  simdjson::dom::element e;
  simdjson::dom::array items;
  if (doc["items"].get(e) || e.is_null()) return std::vector<ListedVolume>{};
  if (e.get_array().get(items)) return absl::InvalidArgumentError("the PersistentVolume list's items is not an array");
  std::vector<ListedVolume> out;
  for (simdjson::dom::element item : items) {
    if (!item.is_object() || Str(item, "/spec/csi/driver") != driver) continue;
    ListedVolume v;
    v.volume_handle = Str(item, "/spec/csi/volumeHandle");
    v.server_image = Str(item, Pointer("/metadata/annotations/", kServerImageAnnotation).c_str());
    v.rollout = Str(item, Pointer("/metadata/annotations/", kServerRolloutAnnotation).c_str());
    if (!v.volume_handle.empty()) out.push_back(std::move(v));
  }
  return out;
}

absl::StatusOr<std::string> ParsePodUid(absl::string_view json) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (parser.parse(json.data(), json.size()).get(doc) || !doc.is_object()) {
    return absl::InvalidArgumentError("the pod is not a JSON object");
  }
  std::string uid = Str(doc, "/metadata/uid");
  if (uid.empty()) return absl::InvalidArgumentError("the pod has no metadata.uid");
  simdjson::dom::element ts;
  if (!doc.at_pointer("/metadata/deletionTimestamp").get(ts) && !ts.is_null()) {
    return absl::FailedPreconditionError("the pod is being deleted");
  }
  return uid;
}

}  // namespace fusekeeper
