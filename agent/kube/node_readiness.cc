#include "agent/kube/node_readiness.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"

namespace fusekeeper {
namespace {

using json = nlohmann::json;

absl::StatusOr<json> ParseObject(const std::string& text, const char* what) {
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("the API server's ", what, " is not a JSON object"));
  }
  return doc;
}

const json* Member(const json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

}  // namespace

absl::StatusOr<bool> CsiNodeListsDriver(const std::string& csinode_json, const std::string& driver) {
  auto doc = ParseObject(csinode_json, "CSINode");
  if (!doc.ok()) return doc.status();
  const json* spec = Member(*doc, "spec");
  const json* drivers = spec != nullptr ? Member(*spec, "drivers") : nullptr;
  if (drivers == nullptr || !drivers->is_array()) return false;
  for (const json& d : *drivers) {
    const json* name = Member(d, "name");
    if (name != nullptr && name->is_string() && name->get<std::string>() == driver) return true;
  }
  return false;
}

absl::StatusOr<std::string> TaintRemovalPatch(const std::string& node_json, const std::string& key) {
  auto doc = ParseObject(node_json, "Node");
  if (!doc.ok()) return doc.status();
  const json* meta = Member(*doc, "metadata");
  const json* version = meta != nullptr ? Member(*meta, "resourceVersion") : nullptr;
  const json* spec = Member(*doc, "spec");
  const json* taints = spec != nullptr ? Member(*spec, "taints") : nullptr;
  if (taints == nullptr || !taints->is_array()) return std::string();
  json kept = json::array();
  bool found = false;
  for (const json& t : *taints) {
    const json* k = Member(t, "key");
    if (k != nullptr && k->is_string() && k->get<std::string>() == key) {
      found = true;
    } else {
      kept.push_back(t);
    }
  }
  if (!found) return std::string();
  if (version == nullptr || !version->is_string()) {
    return absl::InvalidArgumentError("the API server's Node has no metadata.resourceVersion");
  }
  // Guarded: a node changed since it was read (another taint added or removed meanwhile) fails
  // the test, and the agent reads it again, instead of writing back a stale list.
  json patch = json::array({json{{"op", "test"}, {"path", "/metadata/resourceVersion"}, {"value", *version}}});
  if (kept.empty()) {
    patch.push_back(json{{"op", "remove"}, {"path", "/spec/taints"}});
  } else {
    patch.push_back(json{{"op", "replace"}, {"path", "/spec/taints"}, {"value", kept}});
  }
  return patch.dump(-1, ' ', false, json::error_handler_t::replace);
}

NodeReadiness::NodeReadiness(Loop& loop, ApiClient& api, NodeReadinessOptions options)
    : loop_(loop), api_(api), options_(std::move(options)), retry_(loop) {}

void NodeReadiness::Start() { CheckRegistered(); }

void NodeReadiness::RetryLater(void (NodeReadiness::*step)(), const std::string& why) {
  backoff_ = backoff_ == absl::ZeroDuration() ? options_.retry : std::min(backoff_ * 2, options_.max_retry);
  if (!why.empty()) {
    LOG(WARNING) << "readiness taint " << options_.taint_key << " on node " << options_.node << ": " << why
                 << "; trying again in " << backoff_;
  }
  retry_.Arm(absl::ToChronoNanoseconds(backoff_), [this, step] { (this->*step)(); });
}

void NodeReadiness::CheckRegistered() {
  api_.Send("GET", absl::StrCat("/apis/storage.k8s.io/v1/csinodes/", options_.node), "",
            [this](absl::StatusOr<HttpResult> r) {
              if (!r.ok()) return RetryLater(&NodeReadiness::CheckRegistered, std::string(r.status().message()));
              bool listed = false;
              if (r->status == 200) {
                auto l = CsiNodeListsDriver(r->body, options_.driver_name);
                if (!l.ok()) return RetryLater(&NodeReadiness::CheckRegistered, std::string(l.status().message()));
                listed = *l;
              } else if (r->status != 404) {
                return RetryLater(&NodeReadiness::CheckRegistered,
                                  absl::StrCat("reading the CSINode: HTTP ", r->status,
                                               r->status == 403 ? " (the agent's role needs csinodes get)" : ""));
              }
              if (!listed) {
                if (!said_waiting_) {
                  LOG(INFO) << "node " << options_.node << ": waiting for the kubelet to register driver "
                            << options_.driver_name << " (CSINode) before removing taint " << options_.taint_key;
                  said_waiting_ = true;
                }
                // Not an error: the registrar registers within seconds of the agent's socket.
                return RetryLater(&NodeReadiness::CheckRegistered, "");
              }
              backoff_ = absl::ZeroDuration();
              RemoveTaint();
            });
}

void NodeReadiness::RemoveTaint() {
  const std::string path = absl::StrCat("/api/v1/nodes/", options_.node);
  api_.Send("GET", path, "", [this, path](absl::StatusOr<HttpResult> r) {
    if (!r.ok()) return RetryLater(&NodeReadiness::RemoveTaint, std::string(r.status().message()));
    if (r->status != 200) {
      return RetryLater(&NodeReadiness::RemoveTaint,
                        absl::StrCat("reading the node: HTTP ", r->status,
                                     r->status == 403 ? " (the agent's role needs nodes get)" : ""));
    }
    auto patch = TaintRemovalPatch(r->body, options_.taint_key);
    if (!patch.ok()) return RetryLater(&NodeReadiness::RemoveTaint, std::string(patch.status().message()));
    if (patch->empty()) {
      LOG(INFO) << "node " << options_.node << " does not carry taint " << options_.taint_key << ": nothing to remove";
      done_ = true;
      return;
    }
    api_.Send(
        "PATCH", path, *patch,
        [this](absl::StatusOr<HttpResult> p) {
          if (!p.ok()) return RetryLater(&NodeReadiness::RemoveTaint, std::string(p.status().message()));
          if (p->status == 422 || p->status == 409) {
            // The node changed since it was read (the guard failed): read it again.
            return RetryLater(&NodeReadiness::RemoveTaint, "the node changed while the taint was being removed");
          }
          if (p->status != 200) {
            return RetryLater(&NodeReadiness::RemoveTaint,
                              absl::StrCat("patching the node: HTTP ", p->status,
                                           p->status == 403 ? " (the agent's role needs nodes patch)" : ""));
          }
          LOG(INFO) << "node " << options_.node << ": the agent serves; taint " << options_.taint_key << " removed";
          done_ = true;
        },
        "application/json-patch+json");
  });
}

}  // namespace fusekeeper
