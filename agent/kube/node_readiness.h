// NodeReadiness: takes the agent's readiness taint off its own node once the agent can serve
// there, so that node pools can keep workloads off a node until then (as Mountpoint S3's driver
// does): nodes register with `fusekeeper.csi/agent-not-ready:NoExecute` (kubelet
// --register-with-taints, or the node pool's taints); pods that mount fusekeeper volumes are then
// scheduled only once the agent serves CSI, has reconciled its volumes, and the kubelet lists the
// driver on the node's CSINode (the registrar has registered it). Then the agent removes that one
// taint, keeping every other, with a JSON patch guarded by the node's resourceVersion.
//
// The agent never adds the taint: a restart, which finds volumes to adopt and serves them at
// once, leaves the node as it is.
//
// Loop thread only.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/kube/api_client.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

inline constexpr char kReadinessTaint[] = "fusekeeper.csi/agent-not-ready";

struct NodeReadinessOptions {
  std::string node;         // the agent's node
  std::string driver_name;  // as the registrar registers it
  std::string taint_key = kReadinessTaint;
  // Until the CSINode lists the driver, and after errors: from `retry`, doubling up to `max_retry`.
  absl::Duration retry = absl::Seconds(1);
  absl::Duration max_retry = absl::Seconds(30);
};

// Pure halves, tested alone.
// Whether the CSINode (its JSON) lists `driver`.
absl::StatusOr<bool> CsiNodeListsDriver(const std::string& csinode_json, const std::string& driver);
// The JSON patch that removes taint `key` from the node (its JSON), guarded by its
// resourceVersion; empty if the node does not carry it.
absl::StatusOr<std::string> TaintRemovalPatch(const std::string& node_json, const std::string& key);

class NodeReadiness {
 public:
  NodeReadiness(Loop& loop, ApiClient& api, NodeReadinessOptions options);
  NodeReadiness(const NodeReadiness&) = delete;
  NodeReadiness& operator=(const NodeReadiness&) = delete;

  // Starts checking: call once the agent serves CSI and its volumes are reconciled.
  void Start();
  // Done: the taint was removed, or the node did not carry it.
  bool done() const { return done_; }

 private:
  void CheckRegistered();
  void RemoveTaint();
  // Runs `step` after the next backoff; `why` (a failure) is logged, empty: waiting, quietly.
  void RetryLater(void (NodeReadiness::*step)(), const std::string& why);

  Loop& loop_;
  ApiClient& api_;
  const NodeReadinessOptions options_;
  Timer retry_;
  absl::Duration backoff_ = absl::ZeroDuration();
  bool done_ = false;
  bool said_waiting_ = false;
};

}  // namespace fusekeeper
