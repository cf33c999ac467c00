#include "agent/config/agent_config.h"

#include <unistd.h>

#include <cstdlib>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agent/paths/host_path.h"
#include "agent/serverpod/pod_manifest.h"
#include "agent/serverpod/server_spec.h"
#include "gflags/gflags.h"

namespace {

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? std::string(v) : fallback;
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

}  // namespace

DEFINE_string(endpoint, EnvOr("CSI_ENDPOINT", "unix:///csi/csi.sock"),
              "CSI endpoint to listen on, unix:///path/csi.sock (default: $CSI_ENDPOINT)");
DEFINE_string(driver_name, "fusekeeper.csi",
              "CSI driver name reported by GetPluginInfo; must match the CSIDriver object");
DEFINE_string(node_id, "", "node id reported by NodeGetInfo (default: $NODE_NAME, else hostname)");
DEFINE_string(readiness_taint, "fusekeeper.csi/agent-not-ready",
              "in a cluster: the taint key the agent removes from its own node once it serves CSI, has "
              "reconciled its volumes and the kubelet lists the driver on the node's CSINode (node pools "
              "register nodes with <key>:NoExecute to keep workloads off until then); empty: none");
DEFINE_string(kubelet_dir, "/var/lib/kubelet",
              "kubelet root directory; every target and staging path must be below it");
DEFINE_string(state_dir, "/var/lib/fusekeeper",
              "where volume state that outlives the agent process is kept (host path, 0700)");
DEFINE_int32(stats_timeout_ms, 5000,
             "NodeGetVolumeStats reports a volume abnormal if statfs takes longer than this");
DEFINE_string(ephemeral_host_path_prefixes, "",
              "comma-separated absolute paths below which unstaged (CSI inline ephemeral) "
              "hostPath volumes may be mounted; empty refuses them all (pod authors choose "
              "those paths)");
DEFINE_int32(handoff_timeout_ms, 300000,
             "a FUSE volume no server has claimed by then has its connection aborted: it stays "
             "mounted and fails fast (ENOTCONN), a Warning Event says what to check, and a server "
             "that connects later gets a fresh connection");
DEFINE_int32(init_timeout_ms, 30000,
             "a FUSE server that takes a fresh connection and has not answered the kernel's first "
             "requests (FUSE_INIT, then a GETATTR of the mount's root) within this long has the connection "
             "aborted: the mount fails fast (ENOTCONN) instead of hanging every access (kubelet's too), a "
             "Warning Event (FuseServerNotAnswering) names the server, and the next server gets a fresh "
             "connection. 0: no deadline");
DEFINE_int32(redeposit_wait_ms, 1000,
             "after an agent restart, how long a server connecting to a FUSE volume's socket has to "
             "re-deposit its live connection before it is given a fresh one");
DEFINE_int32(server_gone_grace_ms, 2000,
             "a FUSE server that stops is reported as a Warning only if its volume is not unpublished "
             "within this grace (kubelet stops a deleted pod's server sidecar just before unpublishing)");
DEFINE_int32(state_lock_wait_ms, 15000,
             "how long to wait for another agent (e.g. the old one of a rollout, finishing its "
             "shutdown) to release the state dir's lock before exiting with status 4");
DEFINE_string(host_root, "",
              "where the node's root filesystem is mounted in the agent's container (the DaemonSet "
              "mounts it at /host); hostPath volumes are resolved beneath it. Empty: the agent runs "
              "in the node's own root (refused if its root is a container image's overlay)");
DEFINE_int32(max_queued_per_volume, 256,
             "RPCs on a volume with an operation in flight wait their turn (FIFO) instead of getting "
             "ABORTED; more than this many waiting get RESOURCE_EXHAUSTED");
DEFINE_int32(max_queue_wait_ms, 60000,
             "an RPC waiting its turn on a volume longer than this gets ABORTED, naming what it waited on");
DEFINE_int32(probe_loop_stall_ms, 5000,
             "Probe answers not ready while the event loop has been stuck in one callback this long "
             "(the livenessprobe sidecar then restarts the agent)");
DEFINE_int32(pool_threads, 4, "threads for blocking syscalls (mount family)");
DEFINE_int32(pool_max_queued, 1024, "blocking work items allowed to wait before refusing more");
DEFINE_int32(audit_period_ms, 60000,
             "how often every volume's mounts are compared with the mount table, as a safety net "
             "beside mount-table change events and FUSE server connection events");
DEFINE_string(metrics_address, "",
              "host:port (or :port) serving Prometheus /metrics and /healthz; empty: off");
DEFINE_string(kube_secrets_dir, "/var/run/secrets/kubernetes.io/serviceaccount",
              "service account token and ca.crt for the API server (Events) and the kubelet");
DEFINE_string(kubelet_url, EnvOr("NODE_IP", "").empty() ? "" : "https://" + EnvOr("NODE_IP", "") + ":10250/pods",
              "the kubelet's pod list, polled to notice FUSE server container restarts (default: "
              "https://$NODE_IP:10250/pods; empty: off)");
DEFINE_int32(kubelet_poll_period_ms, 10000, "how often the kubelet's pod list is polled");
DEFINE_string(kubelet_ca_file, "", "CA bundle for the kubelet's serving certificate (empty: system CAs)");
DEFINE_bool(kubelet_insecure, false,
            "skip verifying the kubelet's serving certificate (self-signed kubelet certs); explicit opt-in");
DEFINE_string(server_namespace, EnvOr("POD_NAMESPACE", "fusekeeper"),
              "where the agent creates staged volumes' server pods (volume_context serverImage); default: "
              "its own namespace ($POD_NAMESPACE)");
DEFINE_string(server_priority_class, "",
              "priorityClassName of server pods (e.g. one that is never preempted); empty: none");
DEFINE_int32(server_pod_resync_ms, 10000,
             "how often the node's server pods are listed and made to agree with its staged volumes");
DEFINE_string(server_seccomp_profile, "RuntimeDefault",
              "server pods' seccomp profile: RuntimeDefault, Unconfined or Localhost/<profile> (fkserve needs no "
              "io_uring, which containerd 2.0's RuntimeDefault refuses)");
DEFINE_int32(server_grace_period_s, 30, "server pods' terminationGracePeriodSeconds");
DEFINE_int32(server_drain_ms, 25000,
             "a server pod's server asked to stop (its pod deleted, evicted or rolled) serves on this long at most "
             "while its successor starts, and stops as soon as the successor waits to take over; below "
             "--server_grace_period_s; 0: it stops at once (pods then wait for the successor)");
DEFINE_string(server_cpu_request, "10m", "a server pod's cpu request when its volume names none");
DEFINE_string(server_memory_request, "32Mi", "a server pod's memory request when its volume names none");
DEFINE_int32(shutdown_grace_ms, 10000,
             "on SIGTERM, how long in-flight RPCs and blocking work may take to finish");

namespace fusekeeper {
namespace {

absl::Status Bad(const std::string& why) { return absl::InvalidArgumentError(why); }

}  // namespace

absl::StatusOr<AgentConfig> AgentConfig::FromFlags() {
  AgentConfig c;
  c.endpoint = FLAGS_endpoint;
  c.driver_name = FLAGS_driver_name;
  c.node_id = FLAGS_node_id.empty() ? EnvOr("NODE_NAME", HostName()) : FLAGS_node_id;
  c.readiness_taint = FLAGS_readiness_taint;
  c.kubelet_dir = FLAGS_kubelet_dir;
  c.state_dir = FLAGS_state_dir;
  c.host_root = FLAGS_host_root;
  for (absl::string_view p : absl::StrSplit(FLAGS_ephemeral_host_path_prefixes, ',', absl::SkipEmpty())) {
    std::string prefix(p);
    while (prefix.size() > 1 && prefix.back() == '/') prefix.pop_back();
    c.ephemeral_host_path_prefixes.push_back(prefix);
  }
  c.stats_timeout = absl::Milliseconds(FLAGS_stats_timeout_ms);
  c.handoff_timeout = absl::Milliseconds(FLAGS_handoff_timeout_ms);
  c.init_timeout = absl::Milliseconds(FLAGS_init_timeout_ms);
  c.redeposit_wait = absl::Milliseconds(FLAGS_redeposit_wait_ms);
  c.server_gone_grace = absl::Milliseconds(FLAGS_server_gone_grace_ms);
  c.state_lock_wait = absl::Milliseconds(FLAGS_state_lock_wait_ms);
  c.max_queued_per_volume = FLAGS_max_queued_per_volume;
  c.max_queue_wait = absl::Milliseconds(FLAGS_max_queue_wait_ms);
  c.probe_loop_stall = absl::Milliseconds(FLAGS_probe_loop_stall_ms);
  c.pool_threads = FLAGS_pool_threads;
  c.pool_max_queued = FLAGS_pool_max_queued;
  c.audit_period = absl::Milliseconds(FLAGS_audit_period_ms);
  c.metrics_address = FLAGS_metrics_address;
  c.kube_secrets_dir = FLAGS_kube_secrets_dir;
  c.kubelet_url = FLAGS_kubelet_url;
  c.kubelet_poll_period = absl::Milliseconds(FLAGS_kubelet_poll_period_ms);
  c.kubelet_ca_file = FLAGS_kubelet_ca_file;
  c.kubelet_insecure = FLAGS_kubelet_insecure;
  c.server_namespace = FLAGS_server_namespace;
  c.server_priority_class = FLAGS_server_priority_class;
  c.server_pod_resync = absl::Milliseconds(FLAGS_server_pod_resync_ms);
  c.server_seccomp_profile = FLAGS_server_seccomp_profile;
  c.server_grace_period_s = FLAGS_server_grace_period_s;
  c.server_drain_ms = FLAGS_server_drain_ms;
  c.server_cpu_request = FLAGS_server_cpu_request;
  c.server_memory_request = FLAGS_server_memory_request;
  c.shutdown_grace = absl::Milliseconds(FLAGS_shutdown_grace_ms);
  if (absl::Status s = c.Check(); !s.ok()) return s;
  return c;
}

absl::Status AgentConfig::Check() const {
  // Driver names follow the CSI spec (what csi-sanity checks): alphanumeric at both ends,
  // dashes, dots and underscores between, at most 63 characters.
  static const std::regex kDriverName("^[a-zA-Z0-9]([A-Za-z0-9._-]{0,61}[a-zA-Z0-9])?$");
  if (!std::regex_match(driver_name, kDriverName)) {
    return Bad(absl::StrCat("--driver_name '", driver_name,
                            "' is not a valid CSI driver name: 1-63 characters, alphanumeric at both ends, "
                            "with '-', '_' and '.' allowed between"));
  }
  if (node_id.empty()) return Bad("no node id: pass --node_id or set NODE_NAME (downward API spec.nodeName)");
  // A taint key is a qualified name: an optional DNS-subdomain prefix and '/', then a name of at
  // most 63 characters, alphanumeric at both ends.
  static const std::regex kTaintKey(
      "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$");
  if (!readiness_taint.empty() && (readiness_taint.size() > 316 || !std::regex_match(readiness_taint, kTaintKey))) {
    return Bad(absl::StrCat("--readiness_taint '", readiness_taint,
                            "' is not a taint key: [prefix/]name, the name 1-63 characters, alphanumeric at both "
                            "ends, with '-', '_' and '.' between"));
  }
  const struct {
    const char* flag;
    absl::Duration value;
    absl::Duration least;
  } durations[] = {
      {"--stats_timeout_ms", stats_timeout, absl::Milliseconds(1)},
      {"--handoff_timeout_ms", handoff_timeout, absl::Milliseconds(1)},
      {"--redeposit_wait_ms", redeposit_wait, absl::Milliseconds(1)},
      {"--audit_period_ms", audit_period, absl::Milliseconds(1)},
      {"--kubelet_poll_period_ms", kubelet_poll_period, absl::Milliseconds(1)},
      {"--max_queue_wait_ms", max_queue_wait, absl::Milliseconds(1)},
      {"--probe_loop_stall_ms", probe_loop_stall, absl::Milliseconds(1)},
      {"--server_pod_resync_ms", server_pod_resync, absl::Milliseconds(1)},
      {"--shutdown_grace_ms", shutdown_grace, absl::ZeroDuration()},
      {"--server_gone_grace_ms", server_gone_grace, absl::ZeroDuration()},
      {"--state_lock_wait_ms", state_lock_wait, absl::ZeroDuration()},
      {"--init_timeout_ms", init_timeout, absl::ZeroDuration()},
  };
  for (const auto& d : durations) {
    if (d.value < d.least) {
      return Bad(absl::StrCat(d.flag, " must be >= ", absl::ToInt64Milliseconds(d.least)));
    }
  }
  if (pool_threads < 1) return Bad("--pool_threads must be >= 1");
  if (pool_max_queued < 1) return Bad("--pool_max_queued must be >= 1");
  if (max_queued_per_volume < 0) return Bad("--max_queued_per_volume must be >= 0");
  if (const std::string problem = ContainerRootProblem(host_root); !problem.empty()) return Bad(problem);
  if (!host_root.empty() && (host_root[0] != '/' || access(host_root.c_str(), X_OK) != 0)) {
    return Bad(absl::StrCat("--host_root ", host_root, " must be an absolute path to a directory the agent can enter"));
  }
  for (const std::string& prefix : ephemeral_host_path_prefixes) {
    if (auto s = ValidateHostPath(prefix); !s.ok()) {
      return Bad(absl::StrCat("--ephemeral_host_path_prefixes: ", s.message()));
    }
  }
  if (server_grace_period_s < 1 || server_drain_ms < 0 || server_drain_ms >= int64_t{server_grace_period_s} * 1000) {
    return Bad(absl::StrCat("--server_drain_ms must be >= 0 and below --server_grace_period_s (", server_grace_period_s,
                            " s): the kubelet kills a server still draining at the end of its grace period"));
  }
  if (const std::string problem = SeccompProfileProblem(server_seccomp_profile); !problem.empty()) {
    return Bad(absl::StrCat("--server_seccomp_profile: ", problem));
  }
  if (auto s = CheckQuantity(server_cpu_request, "--server_cpu_request"); !s.ok()) return Bad(std::string(s.message()));
  if (auto s = CheckQuantity(server_memory_request, "--server_memory_request"); !s.ok()) {
    return Bad(std::string(s.message()));
  }
  return absl::OkStatus();
}

}  // namespace fusekeeper
