// VolumeManager: NodeGetVolumeStats, and the probes that tell a mount that answers from one that hangs.
#include "agent/volume/volume_manager.h"

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

void VolumeManager::Stats(const csi::v1::NodeGetVolumeStatsRequest& req, StatsDone done) {
  if (!ready_) return done(absl::UnavailableError("fusekeeper is still reconciling volume state; retry"));
  auto it = volumes_.find(req.volume_id());
  if (it == volumes_.end()) {
    return done(absl::NotFoundError(absl::StrCat("volume ", req.volume_id(), " is not known on this node")));
  }
  const state::Volume& v = it->second;
  const std::string& path = req.volume_path();
  PathMounts mounts;
  std::string mount_path = path;
  bool found = false;
  for (const auto& t : v.targets()) {
    if (t.path() == path && !t.pending()) {
      mounts = {t.mount(), TargetBase(t)};
      found = true;
    }
  }
  if (!found && path == v.staging_path() && !v.staging_pending()) {
    mounts = {v.staging_mount(), StagingBase(v)};
    mount_path = StagingMountPath(v);
    found = true;
  }
  if (!found) {
    return done(absl::NotFoundError(absl::StrCat("volume ", req.volume_id(), " is not mounted at ", path)));
  }
  KindOf(v).Stats(v, path, mount_path, mounts, std::move(done));
}

void VolumeManager::Probe(const std::string& path, const std::string& mount_path,
                          const PathMounts& mounts, StatsDone done) {
  auto outstanding = probes_outstanding_.find(mount_path);
  if (outstanding != probes_outstanding_.end()) {
    if (!outstanding->second->answered) {
      // A probe still within its deadline: share its answer (a second statfs would only pin
      // another thread, and reporting the mount unresponsive now would be wrong).
      outstanding->second->dones.push_back(std::move(done));
      return;
    }
    // An earlier statfs of this mount has not returned although its deadline has passed.
    csi::v1::NodeGetVolumeStatsResponse resp;
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(absl::StrCat(
        "an earlier statfs of ", path, " has not returned: the mount is unresponsive"));
    return done(resp);
  }
  // Exactly one answer for everyone waiting: the statfs result or the deadline, whichever comes
  // first.
  auto race = std::make_shared<ProbeRace>(loop_);
  race->dones.push_back(std::move(done));
  const absl::Duration timeout = options_.stats_timeout;
  race->timer.Arm(absl::ToChronoNanoseconds(timeout), [weak = std::weak_ptr<ProbeRace>(race), path, timeout] {
    auto race = weak.lock();
    if (!race || race->answered) return;
    csi::v1::NodeGetVolumeStatsResponse resp;
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(absl::StrCat(
        "statfs of ", path, " did not answer within ", absl::FormatDuration(timeout),
        ": the mount is unresponsive"));
    race->Answer(resp);
  });
  probes_outstanding_[mount_path] = race;
  absl::Status s = probe_pool_->Submit(
      "statfs probe",
      [ctx = ctx_, race, mount_path, mounts] { race->result = StatsBlocking(ctx, mount_path, mounts); },
      [this, race, mount_path](absl::Status ran) {
        probes_outstanding_.erase(mount_path);
        if (race->answered) return;  // the deadline answered already
        race->timer.Cancel();
        race->Answer(ran.ok() ? std::move(race->result) : ran);
      });
  if (!s.ok()) {
    probes_outstanding_.erase(mount_path);
    race->timer.Cancel();
    race->Answer(s);
  }
}

void VolumeManager::ProbeRace::Answer(const absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse>& r) {
  answered = true;
  std::vector<StatsDone> waiting = std::move(dones);
  dones.clear();
  for (auto& d : waiting) d(r);
}

}  // namespace fusekeeper
