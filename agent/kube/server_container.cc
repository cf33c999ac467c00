#include "agent/kube/server_container.h"

namespace fusekeeper {

using ojson = nlohmann::ordered_json;

ojson UnprivilegedSecurityContext(const std::optional<ContainerUser>& user) {
  ojson sc = ojson::object();
  if (user) {
    sc["runAsUser"] = user->uid;
    sc["runAsGroup"] = user->gid;
    sc["runAsNonRoot"] = true;
  }
  sc["allowPrivilegeEscalation"] = false;
  sc["privileged"] = false;
  sc["readOnlyRootFilesystem"] = true;
  sc["capabilities"] = ojson{{"drop", ojson::array({"ALL"})}};
  return sc;
}

namespace {

ojson Mount(const ContainerMount& m) {
  ojson j{{"name", m.volume}, {"mountPath", m.path}};
  if (m.read_only) j["readOnly"] = true;
  return j;
}

}  // namespace

ojson ServerContainerJson(const ServerContainerSpec& s) {
  ojson c{{"name", s.name}, {"image", s.image}};
  if (!s.image_pull_policy.empty()) c["imagePullPolicy"] = s.image_pull_policy;
  if (s.native_sidecar) c["restartPolicy"] = "Always";
  if (!s.command.empty()) c["command"] = s.command;
  if (!s.args.empty()) c["args"] = s.args;
  ojson env = ojson::array({ojson{{"name", "FUSEKEEPER_SOCKET"}, {"value", s.socket_path}}});
  for (const auto& [name, value] : s.env) env.push_back(ojson{{"name", name}, {"value", value}});
  c["env"] = std::move(env);
  ojson resources{{"requests", ojson(s.requests)}};
  if (!s.limits.empty()) resources["limits"] = ojson(s.limits);
  c["resources"] = std::move(resources);
  c["securityContext"] = UnprivilegedSecurityContext(s.user);
  ojson mounts = ojson::array({Mount(s.socket_dir)});
  for (const auto& m : s.mounts) mounts.push_back(Mount(m));
  c["volumeMounts"] = std::move(mounts);
  if (!s.startup_probe.empty()) {
    c["startupProbe"] = ojson{{"exec", ojson{{"command", s.startup_probe}}}, {"periodSeconds", 1}, {"failureThreshold", 300}};
  }
  return c;
}

}  // namespace fusekeeper
