// VolumeManager, part 2: recovery. Detection feeds in from the handoff endpoints (a server's
// connection closed, a server asked for a fresh connection, the kept connection was aborted),
// from the mount table (Audit: on every change event, periodically, and at start-up) and from
// the kubelet (a FUSE server container restarted). Repairs run under the volume's claim, so
// they never race an RPC on the same volume, and are reported as Events and through the hooks
// only after a check through the repaired mount has succeeded.
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/volume/volume_manager.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

bool IsFuseVolume(const state::Volume& v) { return v.kind() == "fuse"; }

// The path of the volume's FUSE mount: the global mount, or an inline volume's only target.
std::string FuseMountPath(const state::Volume& v) {
  if (!v.staging_path().empty()) return v.staging_path();
  return v.targets_size() == 1 ? v.targets(0).path() : "";
}

bool SameDev(const MountEntry* e, const state::MountIdentity& id) {
  return e != nullptr && e->major == id.dev_major() && e->minor == id.dev_minor();
}

}  // namespace

void VolumeManager::EventForVolume(const state::Volume& v, const std::string& type,
                                   const std::string& reason, const std::string& message) {
  LOG_IF(WARNING, type == "Warning") << "volume " << v.volume_id() << ": " << reason << ": " << message;
  LOG_IF(INFO, type != "Warning") << "volume " << v.volume_id() << ": " << reason << ": " << message;
  if (!hooks_.on_event) return;
  std::set<std::string> seen;
  for (const auto& t : v.targets()) {
    if (t.pod_name().empty() || !seen.insert(t.pod_uid() + "/" + t.pod_name()).second) continue;
    hooks_.on_event(PodRef{t.pod_namespace(), t.pod_name(), t.pod_uid()}, type, reason, message);
  }
}

void VolumeManager::OnServerGone(const std::string& volume_id, const std::string& path, const absl::Status& why) {
  auto ep = endpoints_.find(EndpointKey(volume_id, path));
  if (ep == endpoints_.end()) return;
  ep->second.gone_reason = std::string(why.message());
  if (ep->second.recovering_since == absl::InfinitePast()) {
    ep->second.recovering_since = absl::Now();
    ep->second.recovering_how = "server restart";
  }
  // Kubelet stops a pod's containers, its server sidecar too, just before it unpublishes the
  // pod's volumes: a server that stops then is a pod going away, not a failure. So the Warning
  // waits for a short grace, and is dropped if the endpoint is stopped (unpublished) meanwhile.
  ++ep->second.gone_pending;
  const uint64_t serial = ep->second.serial;
  const std::string message = absl::StrCat("the FUSE server of volume ", volume_id, " stopped (", why.message(),
                                           "); the mount is kept open and waits for the server to come back");
  loop_.AddTimer(
      absl::ToChronoNanoseconds(options_.server_gone_grace), [this, volume_id, path, message, serial] {
        auto ep = endpoints_.find(EndpointKey(volume_id, path));
        if (ep == endpoints_.end() || ep->second.serial != serial) return;  // unpublished meanwhile
        --ep->second.gone_pending;
        auto v = volumes_.find(volume_id);
        if (v == volumes_.end()) return;
        if (AllPodsTerminating(v->second)) {
          LOG(INFO) << "volume " << volume_id << ": its FUSE server stopped while its pod is terminating: no Warning";
          return;
        }
        EventForVolume(v->second, "Warning", "FuseServerNotConnected", message);
      });
}

bool VolumeManager::AllPodsTerminating(const state::Volume& v) const {
  bool any = false;
  for (const auto& t : v.targets()) {
    if (t.pod_uid().empty() || terminating_pods_.count(t.pod_uid()) == 0) return false;
    any = true;
  }
  return any;
}

void VolumeManager::OnServed(const std::string& volume_id, const std::string& path, bool adopted) {
  auto ep = endpoints_.find(EndpointKey(volume_id, path));
  if (ep == endpoints_.end()) return;
  ep->second.gone_reason.clear();
  if (ep->second.recovering_since == absl::InfinitePast()) return;  // a first handoff
  const absl::Time since = ep->second.recovering_since;
  const std::string how = ep->second.recovering_how;
  ep->second.recovering_since = absl::InfinitePast();
  auto v = volumes_.find(volume_id);
  if (v != volumes_.end() && adopted) {
    EventForVolume(v->second, "Normal", "FuseServerRestarted",
                   absl::StrCat("a restarted FUSE server adopted the live connection of volume ", volume_id));
  }
  Verify(volume_id, adopted ? "server restart (connection adopted)" : how, since);
}

void VolumeManager::Verify(const std::string& volume_id, const std::string& how, absl::Time since) {
  auto it = volumes_.find(volume_id);
  if (it == volumes_.end()) return;
  const state::Volume& v = it->second;
  struct Check {
    std::string volume_id, how;
    absl::Time since;
    int left = 0;
    int total = 0;
    std::vector<std::string> failed;
  };
  auto check = std::make_shared<Check>();
  check->volume_id = volume_id;
  check->how = how;
  check->since = since;
  std::vector<std::pair<std::string, state::MountIdentity>> paths;
  if (!v.staging_path().empty() && !v.staging_pending()) paths.emplace_back(v.staging_path(), v.staging_mount());
  for (const auto& t : v.targets()) {
    if (!t.pending()) paths.emplace_back(t.path(), t.mount());
  }
  check->left = check->total = static_cast<int>(paths.size());
  auto finish = [this, check] {
    auto v = volumes_.find(check->volume_id);
    const absl::Duration took = absl::Now() - check->since;
    if (check->failed.empty()) {
      if (v != volumes_.end()) {
        // The time taken goes to the log and the metrics, not into the Event: repeats of the same
        // message become count updates.
        LOG(INFO) << "volume " << check->volume_id << " recovered (" << check->how << ") in "
                  << absl::FormatDuration(absl::Trunc(took, absl::Microseconds(1)));
        EventForVolume(v->second, "Normal", "MountRecovered",
                       absl::StrCat("volume ", check->volume_id, ": all ", check->total,
                                    " mount(s) answer through the FUSE server again (", check->how, ")"));
      }
      if (hooks_.on_recovery) hooks_.on_recovery(check->how, "recovered", took);
    } else {
      if (v != volumes_.end()) {
        EventForVolume(v->second, "Warning", "MountRecoveryFailed",
                       absl::StrCat("volume ", check->volume_id, ": ", absl::StrJoin(check->failed, "; ")));
      }
      if (hooks_.on_recovery) hooks_.on_recovery(check->how, "failed", took);
    }
  };
  if (paths.empty()) return finish();
  for (const auto& [path, id] : paths) {
    Probe(path, path, id, [check, path, finish](absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse> r) mutable {
      if (!r.ok()) {
        check->failed.push_back(absl::StrCat(path, ": ", r.status().message()));
      } else if (r->volume_condition().abnormal()) {
        check->failed.push_back(r->volume_condition().message());
      }
      if (--check->left == 0) finish();
    });
  }
}

void VolumeManager::ReportRebind(const RebindOutcome& r) {
  if (r.stacked_removed > 0) {
    EventForVolume(r.volume, "Warning", "StackedMountsRemoved",
                   absl::StrCat(r.stacked_removed, " stacked mount(s) removed from pod targets"));
  }
  if (!r.failed.empty()) {
    EventForVolume(r.volume, "Warning", "MountRecoveryFailed",
                   absl::StrCat("targets not re-bound: ", absl::StrJoin(r.failed, "; ")));
  }
}

void VolumeManager::RetryLater(const std::string& volume_id, absl::AnyInvocable<void()> fn) {
  absl::Duration& d = backoff_[volume_id];
  d = d == absl::ZeroDuration() ? options_.repair_backoff : std::min(d * 2, options_.max_repair_backoff);
  loop_.AddTimer(absl::ToChronoNanoseconds(d), std::move(fn));
}

void VolumeManager::RepairFuse(const std::string& volume_id, const std::string& why) {
  auto it = volumes_.find(volume_id);
  if (it == volumes_.end() || !IsFuseVolume(it->second) || repairing_.count(volume_id) > 0) return;
  const std::string path = FuseMountPath(it->second);
  if (path.empty()) return;
  if (busy_.count(volume_id) > 0) {
    // An RPC on the volume is in flight; it may be unpublishing it. Look again after it.
    return RetryLater(volume_id, [this, volume_id, why] { RepairFuse(volume_id, why); });
  }
  busy_.insert(volume_id);
  repairing_.insert(volume_id);
  const std::string key = EndpointKey(volume_id, path);
  auto ep = endpoints_.find(key);
  absl::Time since = absl::Now();
  if (ep != endpoints_.end()) {
    if (ep->second.recovering_since == absl::InfinitePast()) ep->second.recovering_since = since;
    since = ep->second.recovering_since;
    ep->second.recovering_how = "fresh connection";
  }
  EventForVolume(it->second, "Warning", "FuseServerNotConnected",
                 absl::StrCat("volume ", volume_id, ": ", why, "; mounting a fresh connection"));
  struct Repaired {
    FuseRemounted remounted;
    RebindOutcome rebound;
    UniqueFd listen_fd;
  };
  const bool need_listen = ep == endpoints_.end();
  RunJob<std::shared_ptr<Repaired>>(
      volume_id, "recovery: fresh FUSE connection",
      [ctx = ctx_, v = it->second, need_listen]() -> absl::StatusOr<std::shared_ptr<Repaired>> {
        auto r = std::make_shared<Repaired>();
        auto m = RemountFuseBlocking(ctx, v);
        if (!m.ok()) return m.status();
        r->remounted = std::move(*m);
        auto b = RebindTargetsBlocking(ctx, r->remounted.volume);
        if (!b.ok()) return b.status();
        r->rebound = std::move(*b);
        if (need_listen) {
          auto l = ListenForServerBlocking(ctx, r->rebound.volume);
          if (!l.ok()) return l.status();
          r->listen_fd = std::move(*l);
        }
        return r;
      },
      [this, volume_id, path, key, since](std::shared_ptr<Repaired> r) {
        repairing_.erase(volume_id);
        backoff_.erase(volume_id);
        volumes_[volume_id] = r->rebound.volume;
        auto ep = endpoints_.find(key);
        if (ep != endpoints_.end()) {
          ep->second.endpoint->ReplaceConnection(std::move(r->remounted.fuse_fd));
        } else {
          StartEndpoint(r->rebound.volume, path, std::move(r->remounted.fuse_fd), std::move(r->listen_fd), {}, {},
                        /*unclaimed_timeout=*/false);
          ep = endpoints_.find(key);
        }
        ep->second.recovering_since = since;
        ep->second.recovering_how = "fresh connection";
        ep->second.gave_up = false;
        ep->second.gone_reason.clear();
        ReportRebind(r->rebound);
        LOG(INFO) << "volume " << volume_id << ": fresh FUSE connection mounted at " << path << ", "
                  << r->rebound.rebound.size() << " target(s) re-bound; waiting for a server";
        return absl::OkStatus();
      },
      [this, volume_id, why, since](absl::Status s) {
        if (s.ok()) return;
        repairing_.erase(volume_id);
        auto v = volumes_.find(volume_id);
        if (v == volumes_.end()) return;
        EventForVolume(v->second, "Warning", "MountRecoveryFailed",
                       absl::StrCat("mounting a fresh connection for volume ", volume_id, " failed: ", s.message()));
        if (hooks_.on_recovery) hooks_.on_recovery("fresh connection", "failed", absl::Now() - since);
        RetryLater(volume_id, [this, volume_id, why] { RepairFuse(volume_id, why); });
      });
}

void VolumeManager::Rebind(const std::string& volume_id, const std::string& why,
                           std::optional<state::MountIdentity> adopt_global) {
  auto it = volumes_.find(volume_id);
  if (it == volumes_.end() || repairing_.count(volume_id) > 0) return;
  if (busy_.count(volume_id) > 0) {
    return RetryLater(volume_id, [this, volume_id, why, adopt_global] { Rebind(volume_id, why, adopt_global); });
  }
  busy_.insert(volume_id);
  repairing_.insert(volume_id);
  const absl::Time since = absl::Now();
  LOG(WARNING) << "volume " << volume_id << ": " << why << "; re-binding its pod targets";
  state::Volume v = it->second;
  if (adopt_global) {
    // Stacked on the global mount's base (that is where pod targets follow it from): the base
    // stays the base.
    if (!v.has_staging_base()) *v.mutable_staging_base() = v.staging_mount();
    *v.mutable_staging_mount() = *adopt_global;
    v.set_source_dev_major(adopt_global->dev_major());
    v.set_source_dev_minor(adopt_global->dev_minor());
  }
  RunJob<std::shared_ptr<RebindOutcome>>(
      volume_id, "recovery: re-bind targets",
      [ctx = ctx_, v = std::move(v), adopt = adopt_global.has_value()]() -> absl::StatusOr<std::shared_ptr<RebindOutcome>> {
        if (adopt) {
          if (auto s = ctx.store->SaveBlocking(v); !s.ok()) return s;
        }
        auto r = RebindTargetsBlocking(ctx, v);
        if (!r.ok()) return r.status();
        return std::make_shared<RebindOutcome>(std::move(*r));
      },
      [this, volume_id, since](std::shared_ptr<RebindOutcome> r) {
        repairing_.erase(volume_id);
        backoff_.erase(volume_id);
        volumes_[volume_id] = r->volume;
        ReportRebind(*r);
        if (!r->failed.empty()) {
          if (hooks_.on_recovery) hooks_.on_recovery("re-bind", "failed", absl::Now() - since);
        } else if (!r->rebound.empty()) {
          Verify(volume_id, "re-bind", since);
        }
        return absl::OkStatus();
      },
      [this, volume_id, why, adopt_global](absl::Status s) {
        if (s.ok()) return;
        repairing_.erase(volume_id);
        LOG(ERROR) << "volume " << volume_id << ": re-binding targets failed: " << s;
        RetryLater(volume_id, [this, volume_id, why, adopt_global] { Rebind(volume_id, why, adopt_global); });
      });
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
    std::vector<std::pair<std::string, std::string>> repair;
    std::vector<std::tuple<std::string, std::string, std::optional<state::MountIdentity>>> rebind;
    bool skipped_busy = false;
    for (const auto& [id, v] : volumes_) {
      if (!IsFuseVolume(v) || repairing_.count(id) > 0) continue;
      if (busy_.count(id) > 0) {
        skipped_busy = true;
        continue;
      }
      if (!v.staging_path().empty()) {
        if (v.staging_pending()) continue;
        const MountEntry* global = (*table)->FindTop(kubelet_.MountTablePath(v.staging_path()));
        if (global == nullptr) {
          repair.emplace_back(id, absl::StrCat(why, ": the global mount at ", v.staging_path(), " is gone"));
          continue;
        }
        if (!SameDev(global, v.staging_mount())) {
          state::MountIdentity adopted;
          adopted.set_dev_major(global->major);
          adopted.set_dev_minor(global->minor);
          adopted.set_root(std::string(global->root));
          rebind.emplace_back(id, absl::StrCat(why, ": the global mount at ", v.staging_path(),
                                               " was replaced (", global->fs_type, ")"),
                              adopted);
          continue;
        }
        for (const auto& t : v.targets()) {
          if (t.pending()) continue;
          if (!SameDev((*table)->FindTop(kubelet_.MountTablePath(t.path())), v.staging_mount())) {
            rebind.emplace_back(id, absl::StrCat(why, ": ", t.path(), " is not bound to the global mount"),
                                std::nullopt);
            break;
          }
        }
      } else if (v.targets_size() == 1 && !v.targets(0).pending()) {
        const MountEntry* top = (*table)->FindTop(kubelet_.MountTablePath(v.targets(0).path()));
        if (top == nullptr) {
          repair.emplace_back(id, absl::StrCat(why, ": the FUSE mount at ", v.targets(0).path(), " is gone"));
        } else if (!SameDev(top, v.targets(0).mount())) {
          // Its live layer was removed, leaving the (dead) base on top.
          repair.emplace_back(id, absl::StrCat(why, ": the FUSE mount at ", v.targets(0).path(),
                                               " is no longer the live connection"));
        }
      }
    }
    for (auto& [id, reason] : repair) RepairFuse(id, reason);
    for (auto& [id, reason, adopt] : rebind) Rebind(id, reason, adopt);
    if (skipped_busy && !audit_retry_pending_) {
      // A volume with an RPC (or its start-up socket) in flight is looked at again shortly, not
      // only at the next periodic audit.
      audit_retry_pending_ = true;
      loop_.AddTimer(absl::ToChronoNanoseconds(options_.repair_backoff), [this, why] {
        audit_retry_pending_ = false;
        Audit(why);
      });
    }
    if (done) done();
  });
}

void VolumeManager::ServerContainerRestarted(const PodRef& pod, const std::string& container) {
  for (const auto& [id, v] : volumes_) {
    if (!IsFuseVolume(v)) continue;
    for (const auto& t : v.targets()) {
      if (t.pod_uid() != pod.uid) continue;
      LOG(INFO) << "volume " << id << ": the kubelet reports container " << container << " of pod "
                << pod.namespace_ << "/" << pod.name << " restarted";
      const std::string path = FuseMountPath(v);
      auto ep = endpoints_.find(EndpointKey(id, path));
      if (ep != endpoints_.end() && ep->second.recovering_since == absl::InfinitePast() &&
          !ep->second.endpoint->serving()) {
        ep->second.recovering_since = absl::Now();
        ep->second.recovering_how = "server restart";
      }
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
  for (const auto& [id, v] : volumes_) {
    std::string state = "mounted";
    if (IsFuseVolume(v)) {
      auto ep = endpoints_.find(EndpointKey(id, FuseMountPath(v)));
      if (repairing_.count(id) > 0) {
        state = "repairing";
      } else if (ep == endpoints_.end()) {
        state = "unwatched";
      } else if (ep->second.endpoint->serving()) {
        state = "serving";
      } else if (ep->second.endpoint->awaiting_redeposit()) {
        state = "awaiting_redeposit";  // mounted before an agent restart; its server has not re-deposited
      } else if (ep->second.endpoint->served()) {
        state = "server_gone";
      } else {
        state = "waiting_for_server";
        ++c.handoffs_waiting;
      }
    }
    ++c.volumes_by_kind_state[absl::StrCat(v.kind().empty() ? "hostPath" : v.kind(), "/", state)];
  }
  c.repairs_in_progress = static_cast<int>(repairing_.size());
  return c;
}

}  // namespace fusekeeper
