// fusekeeper: the node agent. Flags are read here and nowhere else; everything below main()
// takes options structs.
//
// Lifecycle: block SIGTERM/SIGINT → open the kubelet dir and state dir → set up the io_uring
// loop (clear failure if io_uring is unavailable) → BlockingPool → CSI server on the socket →
// run the loop on this thread, whose first job reconciles saved volume state with the mount table.
// On SIGTERM/SIGINT: stop accepting RPCs (UNAVAILABLE, Probe not ready), let in-flight RPCs
// finish within --shutdown_grace_ms, stop the pool, stop the loop, remove the socket, exit 0.
#include <signal.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <functional>
#include <regex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "agent/csi/server.h"
#include "agent/loop/blocking_pool.h"
#include "agent/loop/loop.h"
#include "agent/loop/signals.h"
#include "agent/mount/table_reader.h"
#include "agent/mount/table_watcher.h"
#include "agent/kubelet/event_recorder.h"
#include "agent/kubelet/http_client.h"
#include "agent/kubelet/kubelet_poller.h"
#include "agent/kubelet/propagation_watch.h"
#include "agent/metrics/http_server.h"
#include "agent/metrics/metrics.h"
#include "agent/paths/host_path.h"
#include "agent/sys/syscalls.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/serverpod/server_pods.h"
#include "agent/serverpod/server_spec.h"
#include "agent/volume/state_store.h"
#include "agent/volume/volume_manager.h"
#include "agent/version.h"
#include "gflags/gflags.h"
#include "glog/logging.h"

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
              "server pods' seccomp profile: RuntimeDefault, Unconfined or Localhost/<profile>. containerd 2.0's "
              "RuntimeDefault refuses io_uring, which `fkserve launch` (the relay) needs: there, use a Localhost "
              "profile that allows io_uring_setup/enter/register, or Unconfined");
DEFINE_int32(server_grace_period_s, 30, "server pods' terminationGracePeriodSeconds");
DEFINE_int32(server_drain_ms, 25000,
             "a server pod's server asked to stop (its pod deleted, evicted or rolled) serves on this long at most "
             "while its successor starts, and stops as soon as the successor waits to take over; below "
             "--server_grace_period_s; 0: it stops at once (pods then wait for the successor)");
DEFINE_string(server_cpu_request, "10m", "a server pod's cpu request when its volume names none");
DEFINE_string(server_memory_request, "32Mi", "a server pod's memory request when its volume names none");
DEFINE_int32(shutdown_grace_ms, 10000,
             "on SIGTERM, how long in-flight RPCs and blocking work may take to finish");

namespace {

void DefineMetrics(fusekeeper::Metrics& m) {
  using T = fusekeeper::Metrics::Type;
  m.Define("fusekeeper_rpc_duration_seconds", T::kHistogram, "CSI RPC latency by method and result code",
           fusekeeper::Metrics::LatencyBuckets());
  m.Define("fusekeeper_volumes", T::kGauge, "volumes by kind and state");
  m.Define("fusekeeper_volumes_relayed", T::kGauge,
           "serving FUSE volumes whose server relays the connection and restarts its program without errors "
           "(fkserve launch)");
  m.Define("fusekeeper_handoffs_waiting", T::kGauge, "FUSE volumes whose server has not connected yet");
  m.Define("fusekeeper_fuse_servers_not_answering_total", T::kCounter,
           "FUSE connections aborted because the server that took them did not answer within --init_timeout_ms");
  m.Define("fusekeeper_pods_unreachable_by_recovery", T::kGauge,
           "pods mounting one of our volumes in a container without mountPropagation HostToContainer");
  m.Define("fusekeeper_repairs_in_progress", T::kGauge, "volumes being repaired right now");
  m.Define("fusekeeper_recoveries_total", T::kCounter, "finished recoveries by how and outcome");
  m.Define("fusekeeper_recovery_duration_seconds", T::kHistogram,
           "from detecting a broken mount to a check through the repaired mount succeeding",
           fusekeeper::Metrics::LatencyBuckets());
  m.Define("fusekeeper_events_total", T::kCounter, "Kubernetes Events recorded, by reason");
  m.Define("fusekeeper_events_dropped_total", T::kCounter, "Events not posted (spam filter, queue full, errors)");
  m.Define("fusekeeper_kubelet_poll_errors_total", T::kCounter, "failed kubelet /pods polls");
  m.Define("fusekeeper_mount_table_changes_total", T::kCounter, "mount-table change notifications");
  m.Define("fusekeeper_server_pods", T::kGauge, "server pods this node's staged volumes want");
  m.Define("fusekeeper_server_pod_info", T::kGauge,
           "1 for each staged volume's server pod on this node: which image it runs (rolls show here)");
  m.Define("fusekeeper_server_pod_changes_total", T::kCounter,
           "server pods created, deleted, created again (deleted or evicted) and rolled, by what");
  m.Define("fusekeeper_server_pod_api_errors_total", T::kCounter, "failed API server requests about server pods");
  m.Define("fusekeeper_loop_lag_seconds", T::kHistogram, "how late the event loop runs a timer",
           fusekeeper::Metrics::LatencyBuckets());
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetVersionString(fusekeeper::kVersion);
  gflags::SetUsageMessage("fusekeeper CSI node agent for FUSE volumes");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  // Debian builds abseil with absl::Mutex deadlock detection on, which records every lock in a
  // global graph (gRPC locks absl::Mutex on every call): ~16 % of a publish+unpublish pair here
  // (bench/mount_bench). It is a debugging aid; production does without it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Before any thread exists, so that every thread inherits the mask and the loop's signalfd is
  // the only taker. SIGPIPE: a peer closing a socket must be an error code, not our death.
  fusekeeper::BlockSignals({SIGTERM, SIGINT});
  signal(SIGPIPE, SIG_IGN);

  // Driver names follow the CSI spec (what csi-sanity checks): alphanumeric at both ends,
  // dashes, dots and underscores between, at most 63 characters.
  static const std::regex kDriverName("^[a-zA-Z0-9]([A-Za-z0-9._-]{0,61}[a-zA-Z0-9])?$");
  if (!std::regex_match(FLAGS_driver_name, kDriverName)) {
    LOG(ERROR) << "--driver_name '" << FLAGS_driver_name
               << "' is not a valid CSI driver name: 1-63 characters, alphanumeric at both ends, "
                  "with '-', '_' and '.' allowed between";
    return 2;
  }
  std::string node_id = FLAGS_node_id;
  if (node_id.empty()) node_id = EnvOr("NODE_NAME", HostName());
  if (node_id.empty()) {
    LOG(ERROR) << "no node id: pass --node_id or set NODE_NAME (downward API spec.nodeName)";
    return 2;
  }
  if (FLAGS_pool_threads < 1 || FLAGS_pool_max_queued < 1 || FLAGS_shutdown_grace_ms < 0 ||
      FLAGS_stats_timeout_ms < 1 || FLAGS_handoff_timeout_ms < 1 || FLAGS_redeposit_wait_ms < 1 || FLAGS_server_gone_grace_ms < 0 || FLAGS_state_lock_wait_ms < 0 || FLAGS_init_timeout_ms < 0 || FLAGS_audit_period_ms < 1 ||
      FLAGS_kubelet_poll_period_ms < 1 || FLAGS_max_queued_per_volume < 0 || FLAGS_max_queue_wait_ms < 1 ||
      FLAGS_probe_loop_stall_ms < 1) {
    LOG(ERROR) << "--pool_threads, --pool_max_queued, --stats_timeout_ms, --handoff_timeout_ms, --redeposit_wait_ms, "
                  "--audit_period_ms, --kubelet_poll_period_ms, --max_queue_wait_ms and --probe_loop_stall_ms must "
                  "be >= 1; --shutdown_grace_ms, --server_gone_grace_ms, --state_lock_wait_ms, --init_timeout_ms and "
                  "--max_queued_per_volume >= 0";
    return 2;
  }
  if (const std::string problem = fusekeeper::ContainerRootProblem(FLAGS_host_root); !problem.empty()) {
    LOG(ERROR) << problem;
    return 2;
  }
  if (!FLAGS_host_root.empty() && (FLAGS_host_root[0] != '/' || access(FLAGS_host_root.c_str(), X_OK) != 0)) {
    LOG(ERROR) << "--host_root " << FLAGS_host_root << " must be an absolute path to a directory the agent can enter";
    return 2;
  }
  auto kubelet = fusekeeper::KubeletDir::Open(FLAGS_kubelet_dir);
  if (!kubelet.ok()) {
    LOG(ERROR) << kubelet.status().message();
    return 2;
  }
  auto store = fusekeeper::StateStore::Open(FLAGS_state_dir, absl::Milliseconds(FLAGS_state_lock_wait_ms));
  if (!store.ok()) {
    LOG(ERROR) << "--state_dir: " << store.status().message();
    // Another agent already runs on this node: the same exit as a CSI socket that is in use.
    return store.status().code() == absl::StatusCode::kFailedPrecondition ? 4 : 2;
  }

  auto loop_or = fusekeeper::Loop::Create();
  if (!loop_or.ok()) {
    LOG(ERROR) << loop_or.status().message();
    return 3;
  }
  std::unique_ptr<fusekeeper::Loop> loop = std::move(*loop_or);
  fusekeeper::BlockingPool pool(*loop, {.threads = FLAGS_pool_threads,
                                        .max_queued = static_cast<size_t>(FLAGS_pool_max_queued)});

  auto table_reader = fusekeeper::MountTableReader::Create(*loop);
  if (!table_reader.ok()) {
    LOG(ERROR) << table_reader.status().message();
    return 3;
  }
  std::vector<std::string> ephemeral_prefixes;
  for (absl::string_view p : absl::StrSplit(FLAGS_ephemeral_host_path_prefixes, ',', absl::SkipEmpty())) {
    std::string prefix(p);
    while (prefix.size() > 1 && prefix.back() == '/') prefix.pop_back();
    if (auto s = fusekeeper::ValidateHostPath(prefix); !s.ok()) {
      LOG(ERROR) << "--ephemeral_host_path_prefixes: " << s.message();
      return 2;
    }
    ephemeral_prefixes.push_back(prefix);
  }
  std::unique_ptr<fusekeeper::HttpClient> http_client;
  std::optional<fusekeeper::KubeApiConfig> api_config;
  if (auto http_or = fusekeeper::HttpClient::Create(*loop); http_or.ok()) {
    http_client = std::move(*http_or);
  } else {
    LOG(WARNING) << http_or.status();
  }
  const absl::StatusOr<fusekeeper::KubeApiConfig> api_or = fusekeeper::InClusterConfig(FLAGS_kube_secrets_dir);
  if (api_or.ok() && http_client) api_config = *api_or;
  // Staged volumes that declare their server get a pod on this node for it (agent/serverpod).
  std::unique_ptr<fusekeeper::ServerPods> server_pods;
  if (api_config) {
    fusekeeper::ServerPodsOptions so;
    so.settings.namespace_ = FLAGS_server_namespace;
    so.settings.node = node_id;
    so.settings.priority_class = FLAGS_server_priority_class;
    so.settings.default_requests = {{"cpu", FLAGS_server_cpu_request}, {"memory", FLAGS_server_memory_request}};
    so.settings.seccomp_profile = FLAGS_server_seccomp_profile;
    so.settings.termination_grace_seconds = FLAGS_server_grace_period_s;
    so.settings.drain_ms = FLAGS_server_drain_ms;
    if (FLAGS_server_grace_period_s < 1 || FLAGS_server_drain_ms < 0 ||
        FLAGS_server_drain_ms >= int64_t{FLAGS_server_grace_period_s} * 1000) {
      LOG(ERROR) << "--server_drain_ms must be >= 0 and below --server_grace_period_s (" << FLAGS_server_grace_period_s
                 << " s): the kubelet kills a server still draining at the end of its grace period";
      return 2;
    }
    if (const std::string problem = fusekeeper::SeccompProfileProblem(FLAGS_server_seccomp_profile);
        !problem.empty()) {
      LOG(ERROR) << "--server_seccomp_profile: " << problem;
      return 2;
    }
    for (const auto& [what, q] : so.settings.default_requests) {
      if (auto s = fusekeeper::CheckQuantity(q, "--server_" + what + "_request"); !s.ok()) {
        LOG(ERROR) << s.message();
        return 2;
      }
    }
    if (FLAGS_server_pod_resync_ms < 1) {
      LOG(ERROR) << "--server_pod_resync_ms must be >= 1";
      return 2;
    }
    so.resync = absl::Milliseconds(FLAGS_server_pod_resync_ms);
    so.driver_name = FLAGS_driver_name;
    server_pods = std::make_unique<fusekeeper::ServerPods>(*loop, *http_client, pool, *api_config, so,
                                                           fusekeeper::ServerPods::Events{});
    LOG(INFO) << "server pods of staged volumes go to namespace " << FLAGS_server_namespace;
  }
  fusekeeper::VolumeManager volumes(*loop, pool, *kubelet, *store, **table_reader,
                                    {.stats_timeout = absl::Milliseconds(FLAGS_stats_timeout_ms),
                                     .ephemeral_host_path_prefixes = ephemeral_prefixes,
                                     .host_root = FLAGS_host_root,
                                     .socket_dir = FLAGS_state_dir + "/sockets",
                                     .server_pods = server_pods.get(),
                                     .handoff_timeout = absl::Milliseconds(FLAGS_handoff_timeout_ms),
                                     .init_timeout = absl::Milliseconds(FLAGS_init_timeout_ms),
                                     .redeposit_wait = absl::Milliseconds(FLAGS_redeposit_wait_ms),
                                     .server_gone_grace = absl::Milliseconds(FLAGS_server_gone_grace_ms),
                                     .max_queued_per_volume = FLAGS_max_queued_per_volume,
                                     .max_queue_wait = absl::Milliseconds(FLAGS_max_queue_wait_ms)});

  utsname uts{};
  uname(&uts);
  fusekeeper::CsiServerOptions server_options;
  server_options.endpoint = FLAGS_endpoint;
  server_options.identity.driver_name = FLAGS_driver_name;
  server_options.identity.vendor_version = fusekeeper::kVersion;
  server_options.identity.loop_stall_limit = absl::Milliseconds(FLAGS_probe_loop_stall_ms);
  const bool statmount = fusekeeper::sys::HaveStatmount();
  LOG(INFO) << "mount lookups use "
            << (statmount ? "statmount (Linux 6.8+)" : "/proc/self/mountinfo (no statmount)");
  server_options.identity.manifest = {
      {"kernel", uts.release},
      {"io_uring", loop->uses_defer_taskrun() ? "single_issuer+defer_taskrun" : "plain"},
      {"mount_lookup", statmount ? "statmount" : "mountinfo"}};
  server_options.identity.ready = [&volumes] { return volumes.ready(); };
  server_options.node.node_id = node_id;
  fusekeeper::Metrics metrics;
  DefineMetrics(metrics);
  server_options.rpc_observer = [&metrics](const char* method, absl::StatusCode code, absl::Duration latency) {
    metrics.Observe("fusekeeper_rpc_duration_seconds",
                    absl::StrCat(fusekeeper::Metrics::Label("method", method), ",",
                                 fusekeeper::Metrics::Label("code", absl::StatusCodeToString(code))),
                    absl::ToDoubleSeconds(latency));
  };
  metrics.AddCollector([&volumes](fusekeeper::Metrics& m) {
    const auto counts = volumes.counts();
    m.ClearGauge("fusekeeper_volumes");
    for (const auto& [kind_state, n] : counts.volumes_by_kind_state) {
      const size_t slash = kind_state.find('/');
      m.Set("fusekeeper_volumes",
            absl::StrCat(fusekeeper::Metrics::Label("kind", kind_state.substr(0, slash)), ",",
                         fusekeeper::Metrics::Label("state", kind_state.substr(slash + 1))),
            n);
    }
    m.Set("fusekeeper_handoffs_waiting", "", counts.handoffs_waiting);
    m.Set("fusekeeper_repairs_in_progress", "", counts.repairs_in_progress);
    m.Set("fusekeeper_volumes_relayed", "", counts.relayed);
    m.Set("fusekeeper_fuse_servers_not_answering_total", "", static_cast<double>(counts.servers_not_answering));
  });
  // Events go to the API server when running in a cluster; elsewhere they are only logged.
  std::unique_ptr<fusekeeper::EventRecorder> events;
  if (auto api = api_or; api.ok() && http_client) {
    fusekeeper::EventRecorderOptions eo;
    eo.host = node_id;
    events = std::make_unique<fusekeeper::EventRecorder>(*loop, *http_client, pool, *api, eo);
    LOG(INFO) << "Kubernetes Events go to " << api->base_url;
  } else {
    LOG(INFO) << "Kubernetes Events are only logged: " << (api.ok() ? "no HTTP client" : api.status().message());
  }
  metrics.AddCollector([&events](fusekeeper::Metrics& m) {
    if (!events) return;
    const auto& st = events->stats();
    m.Set("fusekeeper_events_dropped_total", fusekeeper::Metrics::Label("why", "spam_filter"), st.spam_dropped);
    m.Set("fusekeeper_events_dropped_total", fusekeeper::Metrics::Label("why", "queue_full"), st.queue_dropped);
    m.Set("fusekeeper_events_dropped_total", fusekeeper::Metrics::Label("why", "api_error"), st.failed);
  });
  metrics.AddCollector([&server_pods](fusekeeper::Metrics& m) {
    if (!server_pods) return;
    const auto& st = server_pods->stats();
    m.Set("fusekeeper_server_pods", "", static_cast<double>(server_pods->wanted().size()));
    using M = fusekeeper::Metrics;
    m.ClearGauge("fusekeeper_server_pod_info");
    for (const auto& [vid, w] : server_pods->wanted()) {
      m.Set("fusekeeper_server_pod_info",
            absl::StrCat(M::Label("volume", vid), ",", M::Label("image", w.spec.image()), ",",
                         M::Label("pod", w.manifest.name)),
            1);
    }
    m.Set("fusekeeper_server_pod_changes_total", M::Label("what", "created"), st.created);
    m.Set("fusekeeper_server_pod_changes_total", M::Label("what", "deleted"), st.deleted);
    m.Set("fusekeeper_server_pod_changes_total", M::Label("what", "recreated"), st.recreated);
    m.Set("fusekeeper_server_pod_changes_total", M::Label("what", "rolled"), st.rolled);
    m.Set("fusekeeper_server_pod_api_errors_total", "", st.api_errors);
  });
  fusekeeper::RecoveryHooks hooks;
  hooks.on_recovery = [&metrics](const std::string& how, const std::string& outcome, absl::Duration latency) {
    const std::string labels = absl::StrCat(fusekeeper::Metrics::Label("how", how), ",",
                                            fusekeeper::Metrics::Label("outcome", outcome));
    metrics.Add("fusekeeper_recoveries_total", labels);
    metrics.Observe("fusekeeper_recovery_duration_seconds", labels, absl::ToDoubleSeconds(latency));
  };
  auto post_event = [&metrics, &events](const fusekeeper::PodRef& pod, const std::string& type,
                                        const std::string& reason, const std::string& message) {
    metrics.Add("fusekeeper_events_total", fusekeeper::Metrics::Label("reason", reason));
    if (events) events->Record({pod.namespace_, pod.name, pod.uid}, type, reason, message);
  };
  hooks.on_event = post_event;
  volumes.set_recovery_hooks(std::move(hooks));
  std::unique_ptr<fusekeeper::KubeletPoller> kubelet_poller;
  std::unique_ptr<fusekeeper::PropagationWatch> propagation_watch;
  metrics.AddCollector([&propagation_watch](fusekeeper::Metrics& m) {
    m.Set("fusekeeper_pods_unreachable_by_recovery", "", propagation_watch ? propagation_watch->unreachable_pods() : 0);
  });
  if (!FLAGS_kubelet_url.empty() && http_client) {
    fusekeeper::KubeletPollerOptions ko;
    ko.url = FLAGS_kubelet_url;
    ko.token_file = FLAGS_kube_secrets_dir + "/token";
    ko.ca_file = FLAGS_kubelet_ca_file;
    ko.insecure = FLAGS_kubelet_insecure;
    ko.period = absl::Milliseconds(FLAGS_kubelet_poll_period_ms);
    kubelet_poller = std::make_unique<fusekeeper::KubeletPoller>(
        *loop, *http_client, pool, ko,
        [&volumes](const fusekeeper::ContainerRestart& r) {
          volumes.ServerContainerRestarted({r.pod_namespace, r.pod_name, r.pod_uid}, r.container);
        },
        [&metrics](const std::string&) { metrics.Add("fusekeeper_kubelet_poll_errors_total", ""); });
    // Pods that mount our volumes without propagation from the host: recovery cannot reach them.
    propagation_watch = std::make_unique<fusekeeper::PropagationWatch>(
        *loop, http_client.get(), pool, api_config, FLAGS_driver_name,
        [&volumes] { return volumes.PublishedVolumeDirsByPod(); },
        [post_event](const std::string& ns, const std::string& name, const std::string& uid,
                     const std::string& message) {
          LOG(WARNING) << "pod " << ns << "/" << name << ": RecoveryCannotReachContainer: " << message;
          post_event({ns, name, uid}, "Warning", "RecoveryCannotReachContainer", message);
        });
    kubelet_poller->set_on_pods([&](const std::vector<fusekeeper::PodStatus>& pods) {
      std::set<std::string> terminating;
      for (const auto& p : pods) {
        if (p.terminating) terminating.insert(p.uid);
      }
      volumes.SetTerminatingPods(std::move(terminating));
      propagation_watch->OnPods(pods);
    });
    loop->Post([&] { kubelet_poller->Start(); });
    LOG(INFO) << "polling the kubelet at " << FLAGS_kubelet_url << " every " << FLAGS_kubelet_poll_period_ms << " ms";
  }
  std::unique_ptr<fusekeeper::HttpServer> http;
  if (!FLAGS_metrics_address.empty()) {
    auto h = fusekeeper::HttpServer::Start(
        *loop, FLAGS_metrics_address,
        {{"/metrics",
          [&metrics] {
            return fusekeeper::HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8", metrics.Render()};
          }},
         {"/healthz", [&volumes] {
            return volumes.ready() ? fusekeeper::HttpResponse{200, "text/plain", "ok\n"}
                                   : fusekeeper::HttpResponse{503, "text/plain", "reconciling volume state\n"};
          }}});
    if (!h.ok()) {
      LOG(ERROR) << "--metrics_address: " << h.status().message();
      return 2;
    }
    http = std::move(*h);
    LOG(INFO) << "metrics and health on " << FLAGS_metrics_address << " (port " << http->port() << ")";
  }
  // Loop lag: how late a timer due every 500 ms fires.
  std::function<void(absl::Time)> lag_probe = [&](absl::Time due) {
    metrics.Observe("fusekeeper_loop_lag_seconds", "", std::max(0.0, absl::ToDoubleSeconds(absl::Now() - due)));
    const absl::Time next = absl::Now() + absl::Milliseconds(500);
    loop->AddTimer(std::chrono::milliseconds(500), [&, next] { lag_probe(next); });
  };
  loop->Post([&] { lag_probe(absl::Now()); });
  auto server_or = fusekeeper::CsiServer::Start(*loop, std::move(server_options), &volumes);
  if (!server_or.ok()) {
    LOG(ERROR) << server_or.status().message();
    return 4;
  }
  std::unique_ptr<fusekeeper::CsiServer> server = std::move(*server_or);

  const absl::Duration grace = absl::Milliseconds(FLAGS_shutdown_grace_ms);
  std::thread shutdown_thread;
  auto signals = fusekeeper::SignalWatcher::Create(*loop, {SIGTERM, SIGINT}, [&](int signo) {
    if (shutdown_thread.joinable()) {
      LOG(WARNING) << strsignal(signo) << " again: already shutting down";
      return;
    }
    LOG(INFO) << strsignal(signo) << ": shutting down (grace " << grace << ")";
    server->BeginDraining();
    // The blocking half of shutdown runs off the loop, which keeps serving in-flight work.
    shutdown_thread = std::thread([&] {
      server->Shutdown(grace);
      pool.Shutdown(grace);
      loop->Stop();
    });
  });
  if (!signals.ok()) {
    LOG(ERROR) << signals.status().message();
    return 5;
  }

  // Recovery's detection: mount-table change events, a periodic audit, and one at start-up.
  std::unique_ptr<fusekeeper::MountTableWatcher> watcher;
  std::function<void()> periodic_audit = [&] {
    volumes.Audit("periodic audit");
    loop->AddTimer(std::chrono::milliseconds(FLAGS_audit_period_ms), periodic_audit);
  };
  loop->Post([&] {
    volumes.Start([&](absl::Status s) {
      if (!s.ok()) {
        LOG(ERROR) << "reconciling volume state failed: " << s
                   << "; Probe stays not-ready and volume RPCs answer UNAVAILABLE";
        return;
      }
      volumes.Audit("start-up");
      auto w = fusekeeper::MountTableWatcher::Start(*loop, [&](fusekeeper::MountTableWatcher::Done done) {
        metrics.Add("fusekeeper_mount_table_changes_total", "");
        volumes.Audit("mount table changed", std::move(done));
      });
      if (w.ok()) {
        watcher = std::move(*w);
      } else {
        LOG(WARNING) << "no mount-table change events (" << w.status()
                     << "); recovery relies on the periodic audit";
      }
      loop->AddTimer(std::chrono::milliseconds(FLAGS_audit_period_ms), periodic_audit);
    });
  });
  LOG(INFO) << "fusekeeper " << fusekeeper::kVersion << " node " << node_id << " driver "
            << FLAGS_driver_name << " kubelet_dir " << kubelet->path() << " state_dir "
            << FLAGS_state_dir << " serving";
  loop->Run();
  if (shutdown_thread.joinable()) shutdown_thread.join();
  server.reset();
  watcher.reset();
  http.reset();
  events.reset();
  kubelet_poller.reset();
  server_pods.reset();
  http_client.reset();
  LOG(INFO) << "fusekeeper stopped";
  return 0;
}
