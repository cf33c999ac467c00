// The agent's configuration: its flags, read here and nowhere else, and checked. main() takes an
// AgentConfig and hands each room the part it needs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fusekeeper {

struct AgentConfig {
  std::string endpoint;
  std::string driver_name;
  std::string node_id;  // --node_id, else $NODE_NAME, else the host name
  std::string readiness_taint;  // removed from the node once the agent serves; empty: none
  std::string kubelet_dir;
  std::string state_dir;
  std::string host_root;
  std::vector<std::string> ephemeral_host_path_prefixes;
  absl::Duration stats_timeout;
  absl::Duration handoff_timeout;
  absl::Duration init_timeout;
  absl::Duration redeposit_wait;
  absl::Duration server_gone_grace;
  absl::Duration state_lock_wait;
  int max_queued_per_volume = 0;
  absl::Duration max_queue_wait;
  absl::Duration probe_loop_stall;
  int pool_threads = 0;
  int pool_max_queued = 0;
  absl::Duration audit_period;
  std::string metrics_address;
  std::string kube_secrets_dir;
  std::string kubelet_url;
  absl::Duration kubelet_poll_period;
  std::string kubelet_ca_file;
  bool kubelet_insecure = false;
  // Server pods of staged volumes (agent/serverpod).
  std::string server_namespace;
  std::string server_priority_class;
  absl::Duration server_pod_resync;
  std::string server_seccomp_profile;
  int server_grace_period_s = 0;
  int64_t server_drain_ms = 0;
  std::string server_cpu_request;
  std::string server_memory_request;
  absl::Duration shutdown_grace;

  // The flags (and $NODE_NAME), checked: INVALID_ARGUMENT naming the flag and its rule.
  static absl::StatusOr<AgentConfig> FromFlags();
  // Every rule, on the values as they are (FromFlags applies it; tests change one value at a time).
  absl::Status Check() const;
};

}  // namespace fusekeeper
