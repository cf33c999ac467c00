// VolumeManager: what recovery reports (Events, recoveries), the audits it runs, and what it tells
// the kubelet watch and the metrics.
#include "agent/volume/volume_manager.h"

#include <memory>
#include <utility>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/paths/host_path.h"
#include "agent/volume/reconcile.h"
#include "agent/volume/volume_spec.h"
#include "glog/logging.h"

namespace fusekeeper {

void VolumeManager::Event(const state::Volume& v, const std::string& type, const std::string& reason,
                          const std::string& message) {
  LOG_IF(WARNING, type == "Warning") << "volume " << v.volume_id() << ": " << reason << ": " << message;
  LOG_IF(INFO, type != "Warning") << "volume " << v.volume_id() << ": " << reason << ": " << message;
  if (!hooks_.on_event) return;
  std::set<std::string> seen;
  for (const auto& t : v.targets()) {
    if (t.pod_name().empty() || !seen.insert(t.pod_uid() + "/" + t.pod_name()).second) continue;
    hooks_.on_event(PodRef{t.pod_namespace(), t.pod_name(), t.pod_uid()}, type, reason, message);
  }
}

bool VolumeManager::AllPodsTerminating(const state::Volume& v) const {
  bool any = false;
  for (const auto& t : v.targets()) {
    if (t.pod_uid().empty() || terminating_pods_.count(t.pod_uid()) == 0) return false;
    any = true;
  }
  return any;
}

void VolumeManager::RefreshPods(absl::AnyInvocable<void()> done) {
  if (!pod_refresher_) return done();
  // std::function needs a copyable callable.
  auto shared = std::make_shared<absl::AnyInvocable<void()>>(std::move(done));
  pod_refresher_([shared] { (*shared)(); });
}

void VolumeManager::RecoveryFinished(const std::string& how, const std::string& outcome, absl::Duration latency) {
  if (hooks_.on_recovery) hooks_.on_recovery(how, outcome, latency);
}

void VolumeManager::Audit(const std::string& why, absl::AnyInvocable<void()> done) {
  if (!ready_) {
    if (done) done();
    return;
  }
  table_reader_.Read([this, why, done = std::move(done)](
                         absl::StatusOr<std::shared_ptr<const MountTable>> table) mutable {
    if (!table.ok()) {
      LOG(WARNING) << "audit (" << why << "): reading the mount table: " << table.status();
      if (done) done();
      return;
    }
    // By id: a kind's repair may change the map.
    std::vector<std::string> ids;
    ids.reserve(volumes_.size());
    for (const auto& [id, v] : volumes_) ids.push_back(id);
    bool skipped_busy = false;
    for (const auto& id : ids) {
      const state::Volume* v = Find(id);
      if (v != nullptr && !KindOf(*v).Audit(**table, *v, why)) skipped_busy = true;
    }
    if (skipped_busy && !audit_retry_.armed()) {
      // A volume with an RPC (or its start-up socket) in flight is looked at again shortly, not
      // only at the next periodic audit.
      audit_retry_.Arm(absl::ToChronoNanoseconds(options_.audit_retry), [this, why] { Audit(why); });
    }
    if (done) done();
  });
}

void VolumeManager::ServerContainerRestarted(const PodRef& pod, const std::string& container) {
  for (const auto& [id, v] : volumes_) {
    for (const auto& t : v.targets()) {
      if (t.pod_uid() != pod.uid) continue;
      KindOf(v).ContainerRestarted(v, pod.uid, absl::StrCat(container, " (", pod.namespace_, "/", pod.name, ")"));
      break;
    }
  }
  Audit("the kubelet reported a container restart");
}

std::map<std::string, std::set<std::string>> VolumeManager::PublishedVolumeDirsByPod() const {
  std::map<std::string, std::set<std::string>> out;
  for (const auto& [id, v] : volumes_) {
    for (const auto& t : v.targets()) {
      if (t.pod_uid().empty() || !absl::EndsWith(t.path(), "/mount")) continue;
      const std::string dir = t.path().substr(0, t.path().size() - 6);
      out[t.pod_uid()].insert(dir.substr(dir.rfind('/') + 1));
    }
  }
  return out;
}

VolumeManager::Counts VolumeManager::counts() const {
  Counts c;
  for (const auto& [id, v] : volumes_) KindOf(v).Count(v, &c);
  for (const auto& [name, kind] : kinds_) kind->CountKind(&c);
  return c;
}

}  // namespace fusekeeper
