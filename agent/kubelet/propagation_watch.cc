#include "agent/kubelet/propagation_watch.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "simdjson.h"

namespace fusekeeper {

std::vector<UnreachableContainer> FindUnreachableContainers(
    const std::vector<PodStatus>& pods, const std::string& driver,
    const std::map<std::string, std::set<std::string>>& published,
    const std::map<std::string, std::string>& claim_volumes, std::set<std::string>* unresolved,
    std::set<std::string>* pods_waiting) {
  std::vector<UnreachableContainer> out;
  for (const PodStatus& pod : pods) {
    auto ours = published.find(pod.uid);
    if (ours == published.end() || pod.terminating) continue;
    std::set<std::string> our_volumes;  // names in the pod's spec
    for (const PodVolume& v : pod.volumes) {
      if (!v.csi_driver.empty()) {
        if (v.csi_driver == driver && ours->second.count(v.name) > 0) our_volumes.insert(v.name);
      } else if (!v.claim_name.empty()) {
        const std::string key = absl::StrCat(pod.namespace_, "/", v.claim_name);
        auto pv = claim_volumes.find(key);
        if (pv == claim_volumes.end()) {
          if (unresolved != nullptr) unresolved->insert(key);
          if (pods_waiting != nullptr) pods_waiting->insert(pod.uid);
        } else if (ours->second.count(pv->second) > 0) {
          our_volumes.insert(v.name);
        }
      }
    }
    for (const VolumeMountUse& m : pod.mounts) {
      if (our_volumes.count(m.volume) == 0) continue;
      if (m.propagation == "HostToContainer" || m.propagation == "Bidirectional") continue;
      out.push_back({pod.namespace_, pod.name, pod.uid, m.container, m.volume,
                     m.propagation.empty() ? "None" : m.propagation});
    }
  }
  return out;
}

PropagationWatch::PropagationWatch(Loop& loop, HttpClient* http, BlockingPool& pool, std::optional<KubeApiConfig> api,
                                   std::string driver, Published published, Warn warn)
    : loop_(loop),
      http_(http),
      api_(std::move(api)),
      driver_(std::move(driver)),
      published_(std::move(published)),
      warn_(std::move(warn)) {
  if (api_) token_.emplace(pool, api_->token_file, absl::Seconds(10));
}

void PropagationWatch::OnPods(const std::vector<PodStatus>& pods) {
  std::set<std::string> unresolved, waiting;
  const auto found = FindUnreachableContainers(pods, driver_, published_(), claim_volumes_, &unresolved, &waiting);
  std::map<std::string, std::vector<const UnreachableContainer*>> by_pod;
  for (const auto& u : found) by_pod[u.pod_uid].push_back(&u);
  unreachable_pods_ = static_cast<int>(by_pod.size());
  for (const auto& [uid, list] : by_pod) {
    // Claims still being looked up: one complete report later rather than a partial one now.
    if ((api_ && waiting.count(uid) > 0) || !warned_.insert(uid).second) continue;
    std::vector<std::string> what;
    for (const auto* u : list) {
      what.push_back(absl::StrCat("container ", u->container, " mounts volume ", u->volume,
                                  " with mountPropagation ", u->propagation));
    }
    const UnreachableContainer& first = *list.front();
    warn_(first.pod_namespace, first.pod_name, uid,
          absl::StrCat(absl::StrJoin(what, "; "), ": if this volume's FUSE connection has to be replaced, ",
                       "fusekeeper's repair cannot reach such a container, which then keeps a dead mount until the "
                       "pod is recreated. Set mountPropagation: HostToContainer on that volumeMount."));
  }
  // Only pods still listed stay remembered, so the set stays bounded.
  std::set<std::string> listed;
  for (const PodStatus& p : pods) listed.insert(p.uid);
  for (auto it = warned_.begin(); it != warned_.end();) it = listed.count(*it) ? std::next(it) : warned_.erase(it);
  for (const std::string& key : unresolved) Resolve(key);
}

void PropagationWatch::Resolve(const std::string& claim_key) {
  if (!api_ || http_ == nullptr || !resolving_.insert(claim_key).second) return;
  const size_t slash = claim_key.find('/');
  token_->Refresh([this, claim_key, slash] {
    HttpRequest r;
    r.url = absl::StrCat(api_->base_url, "/api/v1/namespaces/", claim_key.substr(0, slash),
                         "/persistentvolumeclaims/", claim_key.substr(slash + 1));
    if (!token_->value().empty()) r.headers.push_back(absl::StrCat("Authorization: Bearer ", token_->value()));
    r.ca_file = api_->ca_file;
    r.max_response_bytes = 1 << 20;
    http_->Send(std::move(r), [this, claim_key](absl::StatusOr<HttpResult> res) {
      resolving_.erase(claim_key);
      if (!res.ok() || res->status != 200) {
        LOG(WARNING) << "looking up PersistentVolumeClaim " << claim_key << ": "
                     << (res.ok() ? absl::StrCat("HTTP ", res->status) : std::string(res.status().message()));
        // An answer (not found, forbidden...) settles it as not ours; a transport error is retried.
        if (res.ok()) claim_volumes_[claim_key] = "";
        return;
      }
      simdjson::dom::parser parser;
      simdjson::dom::element doc;
      std::string_view volume;
      if (parser.parse(res->body).get(doc) || doc.at_pointer("/spec/volumeName").get_string().get(volume)) {
        claim_volumes_[claim_key] = "";  // not bound: a pod using it cannot be running with our volume
        return;
      }
      claim_volumes_[claim_key] = std::string(volume);
    });
  });
}

}  // namespace fusekeeper
