// fusekeeper: the node agent. main() wires: the flags come checked from AgentConfig
// (agent/config), the metrics from Telemetry (agent/telemetry); everything else takes options.
//
// Lifecycle: block SIGTERM/SIGINT → open the kubelet dir and state dir → set up the io_uring
// loop (clear failure if io_uring is unavailable) → BlockingPool → CSI server on the socket →
// run the loop on this thread, whose first job reconciles saved volume state with the mount table.
// On SIGTERM/SIGINT: stop accepting RPCs (UNAVAILABLE, Probe not ready), let in-flight RPCs
// finish within --shutdown_grace_ms, stop the pool, stop the loop, remove the socket, exit 0.
#include <signal.h>
#include <sys/utsname.h>

#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "agent/base/fd_limit.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "agent/config/agent_config.h"
#include "agent/csi/server.h"
#include "agent/kube/event_recorder.h"
#include "agent/kube/http_client.h"
#include "agent/kubelet/kubelet_poller.h"
#include "agent/kubelet/propagation_watch.h"
#include "agent/loop/blocking_pool.h"
#include "agent/loop/loop.h"
#include "agent/loop/signals.h"
#include "agent/metrics/http_server.h"
#include "agent/mount/table_reader.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/serverpod/server_pods.h"
#include "agent/sys/syscalls.h"
#include "agent/telemetry/telemetry.h"
#include "agent/version.h"
#include "agent/volume/audits.h"
#include "agent/volume/state_store.h"
#include "agent/kube/api_client.h"
#include "agent/kube/node_readiness.h"
#include "agent/volume/fuse_kind.h"
#include "agent/volume/host_path_kind.h"
#include "agent/volume/volume_manager.h"
#include "gflags/gflags.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

// What the agent talks to beyond the node: the API server (Events, server pods), the kubelet.
struct Cluster {
  std::unique_ptr<HttpClient> http;
  std::optional<KubeApiConfig> api;
  absl::Status api_status;  // why there is no API server, if there is none
};

Cluster ConnectCluster(Loop& loop, const AgentConfig& c) {
  Cluster out;
  if (auto h = HttpClient::Create(loop); h.ok()) {
    out.http = std::move(*h);
  } else {
    LOG(WARNING) << h.status();
  }
  absl::StatusOr<KubeApiConfig> api = InClusterConfig(c.kube_secrets_dir);
  out.api_status = !out.http ? absl::UnavailableError("no HTTP client") : api.status();
  if (api.ok() && out.http) out.api = *api;
  return out;
}

// Staged volumes that declare their server get a pod on this node for it (agent/serverpod).
std::unique_ptr<ServerPods> MakeServerPods(Loop& loop, BlockingPool& pool, Cluster& cluster, const AgentConfig& c) {
  if (!cluster.api) return nullptr;
  ServerPodsOptions so;
  so.settings.namespace_ = c.server_namespace;
  so.settings.node = c.node_id;
  so.settings.priority_class = c.server_priority_class;
  so.settings.default_requests = {{"cpu", c.server_cpu_request}, {"memory", c.server_memory_request}};
  so.settings.seccomp_profile = c.server_seccomp_profile;
  so.settings.termination_grace_seconds = c.server_grace_period_s;
  so.settings.drain_ms = c.server_drain_ms;
  so.resync = c.server_pod_resync;
  so.driver_name = c.driver_name;
  LOG(INFO) << "server pods of staged volumes go to namespace " << c.server_namespace;
  return std::make_unique<ServerPods>(loop, *cluster.http, pool, *cluster.api, so, ServerPods::Events{});
}

// The node's readiness taint (node_readiness.h), in a cluster and unless --readiness_taint="".
struct Readiness {
  std::unique_ptr<ApiClient> api;
  std::unique_ptr<NodeReadiness> taint;
};

Readiness MakeReadiness(Loop& loop, BlockingPool& pool, Cluster& cluster, const AgentConfig& c) {
  Readiness r;
  if (!cluster.api || c.readiness_taint.empty()) return r;
  r.api = std::make_unique<ApiClient>(*cluster.http, pool, *cluster.api, absl::Seconds(10));
  r.taint = std::make_unique<NodeReadiness>(
      loop, *r.api, NodeReadinessOptions{.node = c.node_id, .driver_name = c.driver_name, .taint_key = c.readiness_taint});
  return r;
}

// Events go to the API server when running in a cluster; elsewhere they are only logged.
std::unique_ptr<EventRecorder> MakeEventRecorder(Loop& loop, BlockingPool& pool, Cluster& cluster,
                                                 const AgentConfig& c) {
  if (!cluster.api) {
    LOG(INFO) << "Kubernetes Events are only logged: " << cluster.api_status.message();
    return nullptr;
  }
  EventRecorderOptions eo;
  eo.host = c.node_id;
  LOG(INFO) << "Kubernetes Events go to " << cluster.api->base_url;
  return std::make_unique<EventRecorder>(loop, *cluster.http, pool, *cluster.api, eo);
}

CsiServerOptions ServerOptions(const AgentConfig& c, const Loop& loop, VolumeManager& volumes, Telemetry& telemetry) {
  utsname uts{};
  uname(&uts);
  CsiServerOptions o;
  o.endpoint = c.endpoint;
  o.identity.driver_name = c.driver_name;
  o.identity.vendor_version = kVersion;
  o.identity.loop_stall_limit = c.probe_loop_stall;
  const bool statmount = sys::HaveStatmount();
  LOG(INFO) << "mount lookups use " << (statmount ? "statmount (Linux 6.8+)" : "/proc/self/mountinfo (no statmount)");
  o.identity.manifest = {{"kernel", uts.release},
                         {"io_uring", loop.uses_defer_taskrun() ? "single_issuer+defer_taskrun" : "plain"},
                         {"mount_lookup", statmount ? "statmount" : "mountinfo"}};
  o.identity.ready = [&volumes] { return volumes.ready(); };
  o.node.node_id = c.node_id;
  o.rpc_observer = telemetry.RpcObserver();
  return o;
}

// The kubelet's pod list: server container restarts, terminating pods, and pods that mount our
// volumes without propagation from the host (recovery cannot reach them).
struct KubeletWatch {
  std::unique_ptr<KubeletPoller> poller;
  std::unique_ptr<PropagationWatch> propagation;
};

void StartKubeletWatch(Loop& loop, BlockingPool& pool, Cluster& cluster, const AgentConfig& c, VolumeManager& volumes,
                       Telemetry& telemetry, std::function<void(const PodRef&, const std::string&, const std::string&,
                                                                const std::string&)> post_event,
                       KubeletWatch* w) {
  if (c.kubelet_url.empty() || !cluster.http) return;
  KubeletPollerOptions ko;
  ko.url = c.kubelet_url;
  ko.token_file = c.kube_secrets_dir + "/token";
  ko.ca_file = c.kubelet_ca_file;
  ko.insecure = c.kubelet_insecure;
  ko.period = c.kubelet_poll_period;
  w->poller = std::make_unique<KubeletPoller>(
      loop, *cluster.http, pool, ko,
      [&volumes](const ContainerRestart& r) {
        volumes.ServerContainerRestarted({r.pod_namespace, r.pod_name, r.pod_uid}, r.container);
      },
      [&telemetry](const std::string&) { telemetry.KubeletPollError(); });
  w->propagation = std::make_unique<PropagationWatch>(
      loop, cluster.http.get(), pool, cluster.api, c.driver_name, [&volumes] { return volumes.PublishedVolumeDirsByPod(); },
      [post_event](const std::string& ns, const std::string& name, const std::string& uid, const std::string& message) {
        LOG(WARNING) << "pod " << ns << "/" << name << ": RecoveryCannotReachContainer: " << message;
        post_event({ns, name, uid}, "Warning", "RecoveryCannotReachContainer", message);
      });
  w->poller->set_on_pods([&volumes, w](const std::vector<PodStatus>& pods) {
    std::set<std::string> terminating;
    for (const auto& p : pods) {
      if (p.terminating) terminating.insert(p.uid);
    }
    volumes.SetTerminatingPods(std::move(terminating));
    w->propagation->OnPods(pods);
  });
  // A server that stops is checked against a fresh pod list before it is called a failure.
  volumes.set_pod_refresher([w](std::function<void()> done) { w->poller->PollNow(std::move(done)); });
  loop.Post([w] { w->poller->Start(); });
  LOG(INFO) << "polling the kubelet at " << c.kubelet_url << " every " << c.kubelet_poll_period;
}

absl::StatusOr<std::unique_ptr<HttpServer>> StartMetrics(Loop& loop, const AgentConfig& c, Telemetry& telemetry,
                                                         VolumeManager& volumes) {
  if (c.metrics_address.empty()) return nullptr;
  auto h = HttpServer::Start(
      loop, c.metrics_address,
      {{"/metrics",
        [&telemetry] {
          return HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8", telemetry.metrics().Render()};
        }},
       {"/healthz", [&volumes] {
          return volumes.ready() ? HttpResponse{200, "text/plain", "ok\n"}
                                 : HttpResponse{503, "text/plain", "reconciling volume state\n"};
        }}});
  if (h.ok()) LOG(INFO) << "metrics and health on " << c.metrics_address << " (port " << (*h)->port() << ")";
  return h;
}

VolumeManagerOptions VolumeOptions(const AgentConfig& c) {
  return {.stats_timeout = c.stats_timeout,
          .ephemeral_host_path_prefixes = c.ephemeral_host_path_prefixes,
          .host_root = c.host_root,
          .max_queued_per_volume = c.max_queued_per_volume,
          .max_queue_wait = c.max_queue_wait};
}

// The volume kinds this agent serves.
void AddKinds(VolumeManager& volumes, const AgentConfig& c, ServerPods* server_pods) {
  volumes.AddKind(std::make_unique<HostPathKind>(volumes));
  volumes.AddKind(std::make_unique<FuseKind>(volumes, FuseKindOptions{.socket_dir = c.state_dir + "/sockets",
                                                                      .handoff_timeout = c.handoff_timeout,
                                                                      .redeposit_wait = c.redeposit_wait,
                                                                      .server_gone_grace = c.server_gone_grace,
                                                                      .init_timeout = c.init_timeout,
                                                                      .server_pods = server_pods}));
}

// The volumes' state reconciled first; then recovery's detection (audits) starts.
void StartVolumes(Loop& loop, VolumeManager& volumes, const AgentConfig& c, Telemetry& telemetry,
                  std::unique_ptr<Audits>* audits, NodeReadiness* readiness) {
  loop.Post([&loop, &volumes, &c, &telemetry, audits, readiness] {
    volumes.Start([&loop, &volumes, &c, &telemetry, audits, readiness](absl::Status s) {
      if (!s.ok()) {
        LOG(ERROR) << "reconciling volume state failed: " << s << "; Probe stays not-ready and volume RPCs answer UNAVAILABLE";
        return;
      }
      *audits = Audits::Start(loop, volumes, c.audit_period, [&telemetry] { telemetry.MountTableChanged(); });
      if (readiness != nullptr) readiness->Start();  // CSI is served (the server started first)
    });
  });
}

// Two fds per FUSE volume (its connection and its handoff socket), more while servers connect:
// the runtime's soft limit (containerd 2.x: 1024) ends a node near 500 volumes.
void RaiseOpenFileLimit() {
  std::string said;
  RaiseFdLimit(&said);
  LOG(INFO) << said;
}

int Fail(int code, absl::string_view why) {
  LOG(ERROR) << why;
  return code;
}

}  // namespace
}  // namespace fusekeeper

int main(int argc, char** argv) {
  using namespace fusekeeper;  // NOLINT: main only wires
  gflags::SetVersionString(kVersion);
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
  BlockSignals({SIGTERM, SIGINT});
  signal(SIGPIPE, SIG_IGN);
  RaiseOpenFileLimit();
  const absl::StatusOr<AgentConfig> config = AgentConfig::FromFlags();
  if (!config.ok()) return Fail(2, config.status().message());
  const AgentConfig& c = *config;
  auto kubelet = KubeletDir::Open(c.kubelet_dir);
  if (!kubelet.ok()) return Fail(2, kubelet.status().message());
  auto store = StateStore::Open(c.state_dir, c.state_lock_wait);
  // Another agent already runs on this node: the same exit as a CSI socket that is in use.
  if (!store.ok()) return Fail(absl::IsFailedPrecondition(store.status()) ? 4 : 2, absl::StrCat("--state_dir: ", store.status().message()));
  auto loop = Loop::Create();
  if (!loop.ok()) return Fail(3, loop.status().message());
  BlockingPool pool(**loop, {.threads = c.pool_threads, .max_queued = static_cast<size_t>(c.pool_max_queued)});
  auto table_reader = MountTableReader::Create(**loop);
  if (!table_reader.ok()) return Fail(3, table_reader.status().message());
  Cluster cluster = ConnectCluster(**loop, c);
  std::unique_ptr<ServerPods> server_pods = MakeServerPods(**loop, pool, cluster, c);
  VolumeManager volumes(**loop, pool, *kubelet, *store, **table_reader, VolumeOptions(c));
  AddKinds(volumes, c, server_pods.get());
  Telemetry telemetry;
  std::unique_ptr<EventRecorder> events = MakeEventRecorder(**loop, pool, cluster, c);
  KubeletWatch kubelet_watch;
  telemetry.Watch(&volumes);
  telemetry.Watch(&events);
  telemetry.Watch(&server_pods);
  telemetry.Watch(&kubelet_watch.propagation);
  auto post_event = [&](const PodRef& pod, const std::string& type, const std::string& reason, const std::string& message) {
    telemetry.Event(reason);
    if (events) events->Record({pod.namespace_, pod.name, pod.uid}, type, reason, message);
  };
  volumes.set_recovery_hooks({.on_event = post_event, .on_recovery = [&](const std::string& how, const std::string& outcome,
                                                                          absl::Duration latency) {
                                 telemetry.Recovery(how, outcome, latency);
                               }});
  StartKubeletWatch(**loop, pool, cluster, c, volumes, telemetry, post_event, &kubelet_watch);
  auto http = StartMetrics(**loop, c, telemetry, volumes);
  if (!http.ok()) return Fail(2, absl::StrCat("--metrics_address: ", http.status().message()));
  telemetry.StartLoopLagProbe(**loop);
  auto server = CsiServer::Start(**loop, ServerOptions(c, **loop, volumes, telemetry), &volumes);
  if (!server.ok()) return Fail(4, server.status().message());
  std::thread shutdown_thread;
  auto signals = SignalWatcher::Create(**loop, {SIGTERM, SIGINT}, [&](int signo) {
    if (shutdown_thread.joinable()) return (void)(LOG(WARNING) << strsignal(signo) << " again: already shutting down");
    LOG(INFO) << strsignal(signo) << ": shutting down (grace " << c.shutdown_grace << ")";
    (*server)->BeginDraining();
    // The blocking half of shutdown runs off the loop, which keeps serving in-flight work.
    shutdown_thread = std::thread([&] {
      (*server)->Shutdown(c.shutdown_grace);
      pool.Shutdown(c.shutdown_grace);
      (*loop)->Stop();
    });
  });
  if (!signals.ok()) return Fail(5, signals.status().message());
  std::unique_ptr<Audits> audits;
  Readiness readiness = MakeReadiness(**loop, pool, cluster, c);
  StartVolumes(**loop, volumes, c, telemetry, &audits, readiness.taint.get());
  LOG(INFO) << "fusekeeper " << kVersion << " node " << c.node_id << " driver " << c.driver_name << " kubelet_dir "
            << kubelet->path() << " state_dir " << c.state_dir << " serving";
  (*loop)->Run();
  if (shutdown_thread.joinable()) shutdown_thread.join();
  server->reset();
  audits.reset();
  LOG(INFO) << "fusekeeper stopped";
  return 0;
}
