#include "agent/serverpod/pod_manifest.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "agent/base/sha256.h"
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

using ojson = nlohmann::ordered_json;

// Compact, in the order built; bytes that are not UTF-8 become U+FFFD instead of an exception.
std::string Dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

// What the pod runs: an unprivileged server container (the pod gives it its user).
ojson Container(const ServerPodSettings& settings, const state::ServerPod& server, const std::string& socket) {
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
  return ServerContainerJson(c);
}

}  // namespace

std::string SeccompProfileProblem(const std::string& profile) {
  if (profile == "RuntimeDefault" || profile == "Unconfined") return "";
  if (profile.rfind("Localhost/", 0) == 0 && profile.size() > 10 && profile.find("..") == std::string::npos) return "";
  return absl::StrCat("'", profile, "' is not RuntimeDefault, Unconfined or Localhost/<profile>");
}

namespace {

ojson SeccompProfile(const std::string& profile) {
  if (profile.rfind("Localhost/", 0) == 0) return ojson{{"type", "Localhost"}, {"localhostProfile", profile.substr(10)}};
  return ojson{{"type", profile}};
}

// The pod's spec: what it runs, where and as whom.
ojson PodSpec(const ServerPodSettings& settings, const state::ServerPod& server, uint32_t uid, uint32_t gid) {
  const std::string socket = absl::StrCat(kHandoffDir, "/", kHandoffSocketName);
  ojson spec = ojson::object();
  spec["nodeName"] = settings.node;
  spec["restartPolicy"] = "Always";
  spec["automountServiceAccountToken"] = false;
  spec["enableServiceLinks"] = false;
  spec["terminationGracePeriodSeconds"] = settings.termination_grace_seconds;
  // Bound by name, past the scheduler: it must run wherever the volume is staged, taints or not.
  spec["tolerations"] = ojson::array({ojson{{"operator", "Exists"}}});
  if (!settings.priority_class.empty()) spec["priorityClassName"] = settings.priority_class;
  spec["securityContext"] = ojson{{"runAsNonRoot", true},
                                  {"runAsUser", uid},
                                  {"runAsGroup", gid},
                                  {"seccompProfile", SeccompProfile(settings.seccomp_profile)}};
  spec["containers"] = ojson::array({Container(settings, server, socket)});
  spec["volumes"] = ojson::array({ojson{{"name", kHandoffVolume}, {"emptyDir", ojson{{"sizeLimit", "1Mi"}}}}});
  return spec;
}

}  // namespace

std::string VolumeLabelValue(const std::string& volume_id) { return Sha256Hex(volume_id).substr(0, 32); }
std::string NodeLabelValue(const std::string& node) { return Sha256Hex(node).substr(0, 16); }

std::string NodeSelector(const ServerPodSettings& settings) {
  return absl::StrCat(kManagedByLabel, "=", kManagedBy, ",", kNodeLabel, "=", NodeLabelValue(settings.node));
}

ServerPodManifest BuildServerPod(const ServerPodSettings& settings, const std::string& volume_id,
                                 const state::ServerPod& server, uint32_t uid, uint32_t gid, bool successor) {
  // What the pod runs, as JSON: hashed into its name, so that any change is a new pod.
  const ojson spec = PodSpec(settings, server, uid, gid);
  ServerPodManifest m;
  m.spec_hash = Sha256Hex(Dump(spec)).substr(0, 10);
  const std::string vol = VolumeLabelValue(volume_id), node = NodeLabelValue(settings.node);
  m.name = absl::StrCat("fk-", vol.substr(0, 16), "-", node.substr(0, 8), "-", m.spec_hash, successor ? kSuccessorSuffix : "");
  ojson labels = ojson::object();
  labels[kManagedByLabel] = kManagedBy;
  labels["app.kubernetes.io/component"] = "fuse-server";
  labels[kNodeLabel] = node;
  labels[kVolumeLabel] = vol;
  labels[kSpecLabel] = m.spec_hash;
  ojson annotations = ojson::object();
  annotations[kVolumeAnnotation] = volume_id;
  annotations[kNodeAnnotation] = settings.node;
  const ojson pod = {{"apiVersion", "v1"},
                     {"kind", "Pod"},
                     {"metadata",
                      {{"name", m.name}, {"namespace", settings.namespace_}, {"labels", labels}, {"annotations", annotations}}},
                     {"spec", spec}};
  m.json = Dump(pod);
  return m;
}

}  // namespace fusekeeper
