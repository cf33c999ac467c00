#include "agent/serverpod/pod_manifest.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "agent/base/sha256.h"
#include "agent/base/json.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/kube/server_container.h"

namespace fusekeeper {
namespace {

std::vector<std::string> WithSocket(const google::protobuf::RepeatedPtrField<std::string>& items,
                                    const std::string& socket) {
  std::vector<std::string> out;
  for (const auto& item : items) out.push_back(absl::StrReplaceAll(item, {{"{socket}", socket}}));
  return out;
}

// What the pod runs: an unprivileged server container (the pod gives it its user).
std::string Container(const ServerPodSettings& settings, const state::ServerPod& server, const std::string& socket) {
  ServerContainerSpec c;
  c.name = kServerContainer;
  c.image = server.image();
  c.image_pull_policy = "IfNotPresent";
  c.command = WithSocket(server.command(), socket);
  c.args = WithSocket(server.args(), socket);
  c.socket_path = socket;
  // Requests: the volume's, and the agent's defaults for what it leaves out (always explicit).
  c.requests = settings.default_requests;
  for (const auto& [k, v] : server.requests()) c.requests[k] = v;
  c.limits.insert(server.limits().begin(), server.limits().end());
  c.socket_dir = {kHandoffVolume, kHandoffDir};
  return ServerContainerJson(c).dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace

std::string SeccompProfileProblem(const std::string& profile) {
  if (profile == "RuntimeDefault" || profile == "Unconfined") return "";
  if (profile.rfind("Localhost/", 0) == 0 && profile.size() > 10 && profile.find("..") == std::string::npos) return "";
  return absl::StrCat("'", profile, "' is not RuntimeDefault, Unconfined or Localhost/<profile>");
}

namespace {

std::string SeccompJson(const std::string& profile) {
  if (profile.rfind("Localhost/", 0) == 0) {
    return absl::StrCat(R"({"type":"Localhost","localhostProfile":)", JsonQuote(profile.substr(10)), "}");
  }
  return absl::StrCat(R"({"type":)", JsonQuote(profile), "}");
}

}  // namespace

std::string VolumeLabelValue(const std::string& volume_id) { return Sha256Hex(volume_id).substr(0, 32); }
std::string NodeLabelValue(const std::string& node) { return Sha256Hex(node).substr(0, 16); }

std::string NodeSelector(const ServerPodSettings& settings) {
  return absl::StrCat(kManagedByLabel, "=", kManagedBy, ",", kNodeLabel, "=", NodeLabelValue(settings.node));
}

ServerPodManifest BuildServerPod(const ServerPodSettings& settings, const std::string& volume_id,
                                 const state::ServerPod& server, uint32_t uid, uint32_t gid, bool successor) {
  const std::string socket = absl::StrCat(kHandoffDir, "/", kHandoffSocketName);
  // What the pod runs, as JSON: hashed into its name, so that any change is a new pod.
  const std::string container = Container(settings, server, socket);
  std::string pod_spec = absl::StrCat(
      R"({"nodeName":)", JsonQuote(settings.node), R"(,"restartPolicy":"Always")",
      R"(,"automountServiceAccountToken":false,"enableServiceLinks":false)",
      R"(,"terminationGracePeriodSeconds":)", settings.termination_grace_seconds,
      // Bound by name, past the scheduler: it must run wherever the volume is staged, taints or not.
      R"(,"tolerations":[{"operator":"Exists"}])");
  if (!settings.priority_class.empty()) {
    absl::StrAppend(&pod_spec, R"(,"priorityClassName":)", JsonQuote(settings.priority_class));
  }
  absl::StrAppend(&pod_spec, R"(,"securityContext":{"runAsNonRoot":true,"runAsUser":)", uid, R"(,"runAsGroup":)", gid,
                  R"(,"seccompProfile":)", SeccompJson(settings.seccomp_profile), "}", R"(,"containers":[)", container, "]",
                  R"(,"volumes":[{"name":)", JsonQuote(kHandoffVolume), R"(,"emptyDir":{"sizeLimit":"1Mi"}}]})");
  ServerPodManifest m;
  m.spec_hash = Sha256Hex(pod_spec).substr(0, 10);
  const std::string vol = VolumeLabelValue(volume_id), node = NodeLabelValue(settings.node);
  m.name = absl::StrCat("fk-", vol.substr(0, 16), "-", node.substr(0, 8), "-", m.spec_hash, successor ? kSuccessorSuffix : "");
  m.json = absl::StrCat(
      R"({"apiVersion":"v1","kind":"Pod","metadata":{"name":)", JsonQuote(m.name), R"(,"namespace":)",
      JsonQuote(settings.namespace_), R"(,"labels":{)", JsonQuote(kManagedByLabel), ":", JsonQuote(kManagedBy), ",",
      JsonQuote("app.kubernetes.io/component"), ":", JsonQuote("fuse-server"), ",", JsonQuote(kNodeLabel), ":",
      JsonQuote(node), ",", JsonQuote(kVolumeLabel), ":", JsonQuote(vol), ",", JsonQuote(kSpecLabel), ":",
      JsonQuote(m.spec_hash), R"(},"annotations":{)", JsonQuote(kVolumeAnnotation), ":", JsonQuote(volume_id), ",",
      JsonQuote(kNodeAnnotation), ":", JsonQuote(settings.node), R"(}},"spec":)", pod_spec, "}");
  return m;
}

}  // namespace fusekeeper
