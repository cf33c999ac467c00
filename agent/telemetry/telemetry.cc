#include "agent/telemetry/telemetry.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "agent/kube/event_recorder.h"
#include "agent/kubelet/propagation_watch.h"
#include "agent/serverpod/server_pods.h"
#include "agent/volume/volume_manager.h"

namespace fusekeeper {

Telemetry::Telemetry() {
  Metrics& m = metrics_;
  using T = Metrics::Type;
  m.Define("fusekeeper_rpc_duration_seconds", T::kHistogram, "CSI RPC latency by method and result code",
           Metrics::LatencyBuckets());
  m.Define("fusekeeper_volumes", T::kGauge, "volumes by kind and state");
  m.Define("fusekeeper_volumes_relayed", T::kGauge,
           "serving FUSE volumes whose server relays the connection and restarts its program without errors "
           "(fkserve launch)");
  m.Define("fusekeeper_handoffs_waiting", T::kGauge, "FUSE volumes whose server has not connected yet");
  m.Define("fusekeeper_fuse_servers_not_answering_total", T::kCounter,
           "FUSE connections aborted because the server that took them did not answer within --init_timeout_ms");
  m.Define("fusekeeper_fuse_tuning_total", T::kCounter,
           "per-volume FUSE tuning (readAheadKb, maxBackground, congestionThreshold) written to a connection, by outcome");
  m.Define("fusekeeper_passthrough_backing_files", T::kGauge,
           "FUSE passthrough backing files registered on serving connections (as far as this agent knows)");
  m.Define("fusekeeper_passthrough_backing_files_total", T::kCounter,
           "FUSE passthrough backing files registered for servers, refused (checks or the kernel) and closed, by outcome");
  m.Define("fusekeeper_pods_unreachable_by_recovery", T::kGauge,
           "pods mounting one of our volumes in a container without mountPropagation HostToContainer");
  m.Define("fusekeeper_repairs_in_progress", T::kGauge, "volumes being repaired right now");
  m.Define("fusekeeper_recoveries_total", T::kCounter, "finished recoveries by how and outcome");
  m.Define("fusekeeper_recovery_duration_seconds", T::kHistogram,
           "from detecting a broken mount to a check through the repaired mount succeeding",
           Metrics::LatencyBuckets());
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
           Metrics::LatencyBuckets());
}

RpcDispatcher::Observer Telemetry::RpcObserver() {
  return [this](const char* method, absl::StatusCode code, absl::Duration latency) {
    metrics_.Observe("fusekeeper_rpc_duration_seconds",
                     absl::StrCat(Metrics::Label("method", method), ",",
                                  Metrics::Label("code", absl::StatusCodeToString(code))),
                     absl::ToDoubleSeconds(latency));
  };
}

void Telemetry::Watch(const VolumeManager* volumes) {
  metrics_.AddCollector([volumes](Metrics& m) {
    const auto counts = volumes->counts();
    m.ClearGauge("fusekeeper_volumes");
    for (const auto& [kind_state, n] : counts.volumes_by_kind_state) {
      const size_t slash = kind_state.find('/');
      m.Set("fusekeeper_volumes",
            absl::StrCat(Metrics::Label("kind", kind_state.substr(0, slash)), ",",
                         Metrics::Label("state", kind_state.substr(slash + 1))),
            n);
    }
    m.Set("fusekeeper_handoffs_waiting", "", counts.handoffs_waiting);
    m.Set("fusekeeper_repairs_in_progress", "", counts.repairs_in_progress);
    m.Set("fusekeeper_volumes_relayed", "", counts.relayed);
    m.Set("fusekeeper_fuse_servers_not_answering_total", "", static_cast<double>(counts.servers_not_answering));
    m.Set("fusekeeper_fuse_tuning_total", Metrics::Label("outcome", "applied"),
          static_cast<double>(counts.fuse_tunings_applied));
    m.Set("fusekeeper_fuse_tuning_total", Metrics::Label("outcome", "failed"),
          static_cast<double>(counts.fuse_tunings_failed));
    m.Set("fusekeeper_passthrough_backing_files", "", static_cast<double>(counts.passthrough_held));
    m.Set("fusekeeper_passthrough_backing_files_total", Metrics::Label("outcome", "registered"),
          static_cast<double>(counts.passthrough_registered));
    m.Set("fusekeeper_passthrough_backing_files_total", Metrics::Label("outcome", "refused"),
          static_cast<double>(counts.passthrough_refused));
    m.Set("fusekeeper_passthrough_backing_files_total", Metrics::Label("outcome", "closed"),
          static_cast<double>(counts.passthrough_closed));
  });
}

void Telemetry::Watch(const std::unique_ptr<EventRecorder>* events) {
  metrics_.AddCollector([events](Metrics& m) {
    if (*events == nullptr) return;
    const auto& st = (*events)->stats();
    m.Set("fusekeeper_events_dropped_total", Metrics::Label("why", "spam_filter"), st.spam_dropped);
    m.Set("fusekeeper_events_dropped_total", Metrics::Label("why", "queue_full"), st.queue_dropped);
    m.Set("fusekeeper_events_dropped_total", Metrics::Label("why", "api_error"), st.failed);
  });
}

void Telemetry::Watch(const std::unique_ptr<ServerPods>* server_pods) {
  metrics_.AddCollector([server_pods](Metrics& m) {
    if (*server_pods == nullptr) return;
    const ServerPods& sp = **server_pods;
    const auto& st = sp.stats();
    m.Set("fusekeeper_server_pods", "", static_cast<double>(sp.wanted().size()));
    m.ClearGauge("fusekeeper_server_pod_info");
    for (const auto& [vid, w] : sp.wanted()) {
      m.Set("fusekeeper_server_pod_info",
            absl::StrCat(Metrics::Label("volume", vid), ",", Metrics::Label("image", w.spec.image()), ",",
                         Metrics::Label("pod", w.manifest.name)),
            1);
    }
    m.Set("fusekeeper_server_pod_changes_total", Metrics::Label("what", "created"), st.created);
    m.Set("fusekeeper_server_pod_changes_total", Metrics::Label("what", "deleted"), st.deleted);
    m.Set("fusekeeper_server_pod_changes_total", Metrics::Label("what", "recreated"), st.recreated);
    m.Set("fusekeeper_server_pod_changes_total", Metrics::Label("what", "rolled"), st.rolled);
    m.Set("fusekeeper_server_pod_api_errors_total", "", st.api_errors);
  });
}

void Telemetry::Watch(const std::unique_ptr<PropagationWatch>* propagation) {
  metrics_.AddCollector([propagation](Metrics& m) {
    m.Set("fusekeeper_pods_unreachable_by_recovery", "",
          *propagation != nullptr ? (*propagation)->unreachable_pods() : 0);
  });
}

void Telemetry::Recovery(const std::string& how, const std::string& outcome, absl::Duration latency) {
  const std::string labels = absl::StrCat(Metrics::Label("how", how), ",", Metrics::Label("outcome", outcome));
  metrics_.Add("fusekeeper_recoveries_total", labels);
  metrics_.Observe("fusekeeper_recovery_duration_seconds", labels, absl::ToDoubleSeconds(latency));
}

void Telemetry::Event(const std::string& reason) {
  metrics_.Add("fusekeeper_events_total", Metrics::Label("reason", reason));
}

void Telemetry::KubeletPollError() { metrics_.Add("fusekeeper_kubelet_poll_errors_total", ""); }

void Telemetry::MountTableChanged() { metrics_.Add("fusekeeper_mount_table_changes_total", ""); }

void Telemetry::StartLoopLagProbe(Loop& loop) {
  lag_timer_ = std::make_unique<Timer>(loop);
  loop.Post([this] { ProbeLag(absl::Now()); });
}

void Telemetry::ProbeLag(absl::Time due) {
  metrics_.Observe("fusekeeper_loop_lag_seconds", "", std::max(0.0, absl::ToDoubleSeconds(absl::Now() - due)));
  const absl::Time next = absl::Now() + absl::Milliseconds(500);
  lag_timer_->Arm(std::chrono::milliseconds(500), [this, next] { ProbeLag(next); });
}

}  // namespace fusekeeper
