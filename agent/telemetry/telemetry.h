// The agent's metrics (Prometheus, /metrics): every definition, the collectors that read them
// from the rooms they describe, and the counts the rooms report. main() wires a Telemetry to
// each room; the rooms know nothing of metric names.
//
// Threading: the loop's thread (collectors run when /metrics is rendered, on the loop too).
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "agent/csi/rpc.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"
#include "agent/metrics/metrics.h"

namespace fusekeeper {

class EventRecorder;
class PropagationWatch;
class ServerPods;
class VolumeManager;

class Telemetry {
 public:
  Telemetry();
  Metrics& metrics() { return metrics_; }

  // Per finished CSI RPC: fusekeeper_rpc_duration_seconds by method and code.
  RpcDispatcher::Observer RpcObserver();
  // Collectors: what each room holds when /metrics is read. The pointers may be null, or point
  // at a unique_ptr still empty (the room is made later, or never).
  void Watch(const VolumeManager* volumes);
  void Watch(const std::unique_ptr<EventRecorder>* events);
  void Watch(const std::unique_ptr<ServerPods>* server_pods);
  void Watch(const std::unique_ptr<PropagationWatch>* propagation);

  // Counts the rooms report.
  void Recovery(const std::string& how, const std::string& outcome, absl::Duration latency);
  void Event(const std::string& reason);
  void KubeletPollError();
  void MountTableChanged();

  // fusekeeper_loop_lag_seconds: how late `loop` runs a timer due every 500 ms, from now on.
  void StartLoopLagProbe(Loop& loop);

 private:
  void ProbeLag(absl::Time due);
  Metrics metrics_;
  std::unique_ptr<Timer> lag_timer_;
};

}  // namespace fusekeeper
