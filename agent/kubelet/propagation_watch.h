// PropagationWatch: names the containers recovery cannot reach.
//
// A repair that mounts a fresh connection reaches a running container only through mount
// propagation: the container's copy of the volume must be a slave of the pod target
// (`mountPropagation: HostToContainer`, or Bidirectional). The default, None, gives the container
// a private copy that keeps a dead connection until the pod is recreated. From each kubelet
// PodList, this finds pods that mount one of our published volumes (an inline CSI volume of our
// driver, or a PVC whose bound PV we published for that pod; PVCs are resolved once through the
// API server) in a container without such propagation, and reports each pod once.
// Loop thread only.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "agent/kube/event_recorder.h"
#include "agent/kube/http_client.h"
#include "agent/kubelet/pod_list.h"
#include "agent/kube/token_file.h"
#include "agent/loop/blocking_pool.h"

namespace fusekeeper {

struct UnreachableContainer {
  std::string pod_namespace, pod_name, pod_uid;
  std::string container, volume, propagation;
};

// Pure: the containers of `pods` that mount one of our volumes without propagation from the
// host. `published`: pod uid → names of the volume directories we published into that pod
// (`…/volumes/kubernetes.io~csi/<name>/mount`). `claim_volumes`: "namespace/claim" → bound PV
// name ("" if it is not bound or not to be found), for the PVCs resolved so far; claims of pods we
// published into that are not in it yet are added to `unresolved`, and those pods to
// `pods_waiting` (nothing is reported for them until every claim is known).
std::vector<UnreachableContainer> FindUnreachableContainers(
    const std::vector<PodStatus>& pods, const std::string& driver,
    const std::map<std::string, std::set<std::string>>& published,
    const std::map<std::string, std::string>& claim_volumes, std::set<std::string>* unresolved,
    std::set<std::string>* pods_waiting);

class PropagationWatch {
 public:
  using Published = std::function<std::map<std::string, std::set<std::string>>()>;
  // (pod namespace, name, uid, message) → a Warning Event for that pod.
  using Warn = std::function<void(const std::string&, const std::string&, const std::string&, const std::string&)>;
  // `api`: where to resolve PVCs (nullopt: outside a cluster, PVC-backed volumes are not checked).
  PropagationWatch(Loop& loop, HttpClient* http, BlockingPool& pool, std::optional<KubeApiConfig> api,
                   std::string driver, Published published, Warn warn);

  // A fresh PodList from the kubelet.
  void OnPods(const std::vector<PodStatus>& pods);
  // Pods with at least one unreachable container, in the last PodList.
  int unreachable_pods() const { return unreachable_pods_; }

 private:
  void Resolve(const std::string& claim_key);

  Loop& loop_;
  HttpClient* http_;
  std::optional<KubeApiConfig> api_;
  std::optional<TokenFile> token_;
  const std::string driver_;
  Published published_;
  Warn warn_;
  std::map<std::string, std::string> claim_volumes_;  // "ns/claim" → PV name
  std::set<std::string> resolving_;
  std::set<std::string> warned_;  // pod uids
  int unreachable_pods_ = 0;
};

}  // namespace fusekeeper
