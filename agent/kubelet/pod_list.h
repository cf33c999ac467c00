// The kubelet's PodList (GET /pods), reduced to what recovery needs: each pod's identity and
// its containers' (and init containers': native sidecars) restart signals. Parsed with
// simdjson; malformed input is an error naming the problem, never a crash.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fusekeeper {

struct ContainerStatus {
  std::string name;
  bool init = false;          // from initContainerStatuses (native sidecars live there)
  std::string container_id;   // "containerd://…"; changes on every restart
  int64_t restart_count = 0;
  std::string started_at;     // state.running.startedAt; empty when not running
};

// A volume of the pod's spec, as far as telling whose it is goes.
struct PodVolume {
  std::string name;
  std::string csi_driver;  // spec.volumes[].csi.driver (inline CSI volumes)
  std::string claim_name;  // spec.volumes[].persistentVolumeClaim.claimName
};

// One volumeMount of one container (init containers included: native sidecars are there).
struct VolumeMountUse {
  std::string container;
  std::string volume;
  std::string propagation;  // mountPropagation; empty: the default, None
};

struct PodStatus {
  std::string namespace_, name, uid;
  bool terminating = false;  // metadata.deletionTimestamp is set
  std::vector<ContainerStatus> containers;
  std::vector<PodVolume> volumes;
  std::vector<VolumeMountUse> mounts;
};

absl::StatusOr<std::vector<PodStatus>> ParsePodList(absl::string_view json);

struct ContainerRestart {
  std::string pod_namespace, pod_name, pod_uid, container;
  int64_t restart_count = 0;
};

// Remembers what it saw; reports containers whose id, restart count or start time changed
// since the previous PodList. Containers seen for the first time are not restarts. Pods that
// are gone are forgotten.
class RestartDetector {
 public:
  std::vector<ContainerRestart> Update(const std::vector<PodStatus>& pods);

 private:
  struct Seen {
    std::string container_id;
    int64_t restart_count = 0;
    std::string started_at;
  };
  std::map<std::string, Seen> seen_;  // "<pod uid>/<init?>/<container>"
};

}  // namespace fusekeeper
