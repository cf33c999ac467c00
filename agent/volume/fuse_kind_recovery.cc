// FuseKind, part 2: recovery (see fuse_kind.h).
#include <fcntl.h>

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/volume/fuse_kind.h"
#include "agent/volume/mount_stack.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

bool SameDev(const MountEntry* e, const state::MountIdentity& id) {
  return e != nullptr && e->major == id.dev_major() && e->minor == id.dev_minor();
}

}  // namespace

void FuseKind::StartingBlocking() {
  // Staged volumes' handoff sockets: one an agent killed between its bind and its rename left
  // under a temporary name. (Those in pods' emptyDirs go when their socket is made again, or
  // torn down: HandoffEndpoint::ListenBlocking, RemoveSocketBlocking.)
  UniqueFd dir(open(options_.socket_dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir) return;  // none made yet
  if (const int n = HandoffEndpoint::RemoveStaleTempSocketsBlocking(dir.get()); n > 0) {
    LOG(INFO) << "removed " << n << " temporary handoff socket name(s) a killed agent left in " << options_.socket_dir;
  }
}

void FuseKind::Started() {
  // The FUSE connections of volumes mounted before a restart died with the old agent's fds
  // only if their servers are gone too. Each volume gets its handoff socket back, without a
  // connection to offer: a server still serving it re-deposits its fd there (handoff_protocol.h),
  // and a server that connects without one is given a fresh connection.
  for (const auto& [id, v] : host_.volumes()) {
    if (v.kind() != kFuseKind || v.fuse().socket_path().empty()) continue;
    const std::string path = FuseMountPath(v);
    if (path.empty() || endpoints_.Find(id, path) != nullptr) continue;
    // Under the volume's claim: a repair (which makes the socket again itself) or an RPC on the
    // volume must not interleave with replacing its socket file. A volume that is busy now gets
    // its socket from that work's repair instead.
    ClaimQueue::Claim claim = host_.TryClaim(id);
    if (!claim) continue;
    restoring_.insert(id);
    host_.RunClaimed(
        std::move(claim),
        KindJob{"handoff socket after restart",
                [this, ctx = host_.ops_context(), v = v, id = id, path]() -> absl::StatusOr<AdoptFn> {
                  auto listen = ListenForServerBlocking(ctx, v);
                  if (!listen.ok()) return listen.status();
                  return AdoptFn([this, id, path, socket = std::make_shared<HandoffSocket>(std::move(*listen))] {
                    if (const state::Volume* now = host_.Find(id); now != nullptr) {
                      StartEndpoint(*now, path, UniqueFd(), std::move(*socket), {}, {}, /*unclaimed_timeout=*/false);
                    }
                    return VolumeChange::Keep();
                  });
                }},
        [this, id = id](absl::Status s) {
          restoring_.erase(id);
          LOG_IF(WARNING, !s.ok()) << "volume " << id << ": cannot listen for its FUSE server again: " << s;
        });
  }
  // The server pods an earlier agent made: wanted again (found by name, not made twice), and
  // from now on kept as the staged volumes want them; pods no volume wants are deleted.
  if (options_.server_pods != nullptr) {
    for (const auto& [id, v] : host_.volumes()) {
      if (v.kind() != kFuseKind || v.staging_path().empty() || v.fuse().server_pod().image().empty()) continue;
      options_.server_pods->Want(id, v.fuse().server_pod(), v.fuse().server_uid(), v.fuse().server_gid());
    }
    options_.server_pods->Start();
  }
}

void FuseKind::OnServerGone(const std::string& volume_id, const std::string& path, const absl::Status& why) {
  FuseEndpoint* ep = endpoints_.Find(volume_id, path);
  if (ep == nullptr) return;
  ep->gone_reason = std::string(why.message());
  if (ep->recovering_since == absl::InfinitePast()) {
    ep->recovering_since = absl::Now();
    ep->recovering_how = "server restart";
  }
  // Kubelet stops a pod's containers, its server sidecar too, just before it unpublishes the
  // pod's volumes: a server that stops then is a pod going away, not a failure. So the Warning
  // waits for a short grace, and is dropped if the endpoint is stopped (unpublished) meanwhile.
  ++ep->gone_pending;
  // If no server serves the volume again within handoff_timeout, it is given up on as if none
  // had ever come (OnHandoffTimeout): the pod fails fast instead of waiting forever.
  ep->handoff_deadline.Arm(absl::ToChronoNanoseconds(options_.handoff_timeout),
                           [this, volume_id, path] { OnHandoffTimeout(volume_id, path); });
  const uint64_t serial = ep->serial;
  const std::string message = absl::StrCat("the FUSE server of volume ", volume_id, " stopped (", why.message(),
                                           "); the mount is kept open and waits for the server to come back");
  later_.Add(
      absl::ToChronoNanoseconds(options_.server_gone_grace), [this, volume_id, path, message, serial] {
        FuseEndpoint* ep = endpoints_.Find(volume_id, path, serial);
        if (ep == nullptr) return;  // unpublished meanwhile
        --ep->gone_pending;
        const state::Volume* v = host_.Find(volume_id);
        if (v == nullptr) return;
        if (ep->endpoint->serving()) {
          // A server took the volume again within the grace (adopted, or given a fresh
          // connection): the volume is fine, and a Warning now would say otherwise.
          LOG(INFO) << "volume " << volume_id << ": its FUSE server is back within "
                    << absl::FormatDuration(options_.server_gone_grace) << ": no Warning";
          return;
        }
        if (host_.AllPodsTerminating(*v)) return ServerGoneSettled(volume_id, path, message, serial);
        // The pod list read last may predate the pod's deletion (the kubelet stops a deleted
        // pod's sidecar within seconds): asked again before this is called a failure.
        host_.RefreshPods([this, volume_id, path, message, serial] {
          ServerGoneSettled(volume_id, path, message, serial);
        });
      });
}

void FuseKind::ServerGoneSettled(const std::string& volume_id, const std::string& path, const std::string& message,
                                 uint64_t serial) {
  FuseEndpoint* ep = endpoints_.Find(volume_id, path, serial);
  const state::Volume* v = host_.Find(volume_id);
  if (ep == nullptr || v == nullptr) return;  // unpublished meanwhile
  if (ep->endpoint->serving()) {
    LOG(INFO) << "volume " << volume_id << ": its FUSE server is back: no Warning";
    return;
  }
  if (host_.AllPodsTerminating(*v)) {
    LOG(INFO) << "volume " << volume_id << ": its FUSE server stopped while its pod is terminating: no Warning";
    return;
  }
  host_.Event(*v, "Warning", "FuseServerNotConnected", message);
}

void FuseKind::OnServed(const std::string& volume_id, const std::string& path, bool adopted) {
  FuseEndpoint* ep = endpoints_.Find(volume_id, path);
  if (ep == nullptr) return;
  ep->gone_reason.clear();
  if (ep->recovering_since == absl::InfinitePast()) return;  // a first handoff
  const absl::Time since = ep->recovering_since;
  const std::string how = ep->recovering_how;
  ep->recovering_since = absl::InfinitePast();
  const state::Volume* v = host_.Find(volume_id);
  if (v != nullptr && adopted) {
    host_.Event(*v, "Normal", "FuseServerRestarted",
                absl::StrCat("a restarted FUSE server adopted the live connection of volume ", volume_id));
  }
  Verify(volume_id, adopted ? "server restart (connection adopted)" : how, since);
}

void FuseKind::Verify(const std::string& volume_id, const std::string& how, absl::Time since) {
  const state::Volume* found = host_.Find(volume_id);
  if (found == nullptr) return;
  const state::Volume& v = *found;
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
  // Each path's top, and the base its containers follow: recovered means the top answers and
  // lies where those containers see it (StatsBlocking).
  std::vector<std::pair<std::string, PathMounts>> paths;
  if (!v.staging_path().empty() && !v.staging_pending()) paths.emplace_back(v.staging_path(), MountsAt(v, v.staging_path()));
  for (const auto& t : v.targets()) {
    if (!t.pending()) paths.emplace_back(t.path(), MountsAt(v, t.path()));
  }
  check->left = check->total = static_cast<int>(paths.size());
  auto finish = [this, check] {
    const state::Volume* v = host_.Find(check->volume_id);
    const absl::Duration took = absl::Now() - check->since;
    if (check->failed.empty()) {
      if (v != nullptr) {
        // The time taken goes to the log and the metrics, not into the Event: repeats of the same
        // message become count updates.
        LOG(INFO) << "volume " << check->volume_id << " recovered (" << check->how << ") in "
                  << absl::FormatDuration(absl::Trunc(took, absl::Microseconds(1)));
        host_.Event(*v, "Normal", "MountRecovered",
                    absl::StrCat("volume ", check->volume_id, ": all ", check->total,
                                 " mount(s) answer through the FUSE server again (", check->how, ")"));
      }
      host_.RecoveryFinished(check->how, "recovered", took);
    } else {
      if (v != nullptr) {
        host_.Event(*v, "Warning", "MountRecoveryFailed",
                    absl::StrCat("volume ", check->volume_id, ": ", absl::StrJoin(check->failed, "; ")));
      }
      host_.RecoveryFinished(check->how, "failed", took);
    }
  };
  if (paths.empty()) return finish();
  for (const auto& [path, mounts] : paths) {
    host_.Probe(path, path, mounts, [check, path, finish](StatsResult r) mutable {
      if (!r.ok()) {
        check->failed.push_back(absl::StrCat(path, ": ", r.status().message()));
      } else if (r->volume_condition().abnormal()) {
        check->failed.push_back(r->volume_condition().message());
      }
      if (--check->left == 0) finish();
    });
  }
}

void FuseKind::ReportRebind(const RebindOutcome& r) {
  if (r.stacked_removed > 0) {
    host_.Event(r.volume, "Warning", "StackedMountsRemoved",
                absl::StrCat(r.stacked_removed, " stacked mount(s) removed from pod targets"));
  }
  if (!r.failed.empty()) {
    host_.Event(r.volume, "Warning", "MountRecoveryFailed",
                absl::StrCat("targets not re-bound: ", absl::StrJoin(r.failed, "; ")));
  }
}

void FuseKind::RepairFuse(const std::string& volume_id, const std::string& why) {
  const state::Volume* v = host_.Find(volume_id);
  if (v == nullptr || v->kind() != kFuseKind || repairs_.running(volume_id)) return;
  const std::string path = FuseMountPath(*v);
  if (path.empty()) return;
  ClaimQueue::Claim claim = host_.TryClaim(volume_id);
  if (!claim) {
    // An RPC on the volume is in flight; it may be unpublishing it. Look again after it.
    return (void)repairs_.RetryLater(volume_id, [this, volume_id, why] { RepairFuse(volume_id, why); });
  }
  repairs_.Began(volume_id);
  FuseEndpoint* ep = endpoints_.Find(volume_id, path);
  absl::Time since = absl::Now();
  if (ep != nullptr) {
    if (ep->recovering_since == absl::InfinitePast()) ep->recovering_since = since;
    since = ep->recovering_since;
    ep->recovering_how = "fresh connection";
    // The job aborts the old connection first (RemountFuseBlocking): our own act.
    ep->endpoint->ExpectAbort();
  }
  host_.Event(*v, "Warning", "FuseServerNotConnected",
              absl::StrCat("volume ", volume_id, ": ", why, "; mounting a fresh connection"));
  struct Repaired {
    FuseRemounted remounted;
    RebindOutcome rebound;
    HandoffSocket socket;
  };
  const bool need_listen = ep == nullptr;
  KindJob job{
      "recovery: fresh FUSE connection",
      [this, ctx = host_.ops_context(), v = *v, need_listen, volume_id, path, since]() -> absl::StatusOr<AdoptFn> {
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
          r->socket = std::move(*l);
        }
        return AdoptFn([this, r, volume_id, path, since] {
          repairs_.Succeeded(volume_id);
          FuseEndpoint* ep = endpoints_.Find(volume_id, path);
          if (ep != nullptr) {
            ep->StopAnswerProbe();  // the connection it asked through is gone
            ep->endpoint->ReplaceConnection(std::move(r->remounted.fuse_fd));
          } else {
            StartEndpoint(r->rebound.volume, path, std::move(r->remounted.fuse_fd), std::move(r->socket), {}, {},
                          /*unclaimed_timeout=*/false);
            ep = endpoints_.Find(volume_id, path);
          }
          ep->recovering_since = since;
          ep->recovering_how = "fresh connection";
          ep->gave_up = false;
          ep->gone_reason.clear();
          ReportRebind(r->rebound);
          LOG(INFO) << "volume " << volume_id << ": fresh FUSE connection mounted at " << path << ", "
                    << r->rebound.rebound.size() << " target(s) re-bound; waiting for a server";
          return VolumeChange::Set(r->rebound.volume);
        });
      }};
  host_.RunClaimed(std::move(claim), std::move(job), [this, volume_id, why, since](absl::Status s) {
    if (s.ok()) return;
    repairs_.Failed(volume_id);
    const state::Volume* v = host_.Find(volume_id);
    if (v == nullptr) return;
    host_.Event(*v, "Warning", "MountRecoveryFailed",
                absl::StrCat("mounting a fresh connection for volume ", volume_id, " failed: ", s.message()));
    host_.RecoveryFinished("fresh connection", "failed", absl::Now() - since);
    repairs_.RetryLater(volume_id, [this, volume_id, why] { RepairFuse(volume_id, why); });
  });
}

void FuseKind::Rebind(const std::string& volume_id, const std::string& why,
                      std::optional<state::MountIdentity> adopt_global) {
  const state::Volume* found = host_.Find(volume_id);
  if (found == nullptr || repairs_.running(volume_id)) return;
  ClaimQueue::Claim claim = host_.TryClaim(volume_id);
  if (!claim) {
    auto again = [this, volume_id, why, adopt_global] { Rebind(volume_id, why, adopt_global); };
    return (void)repairs_.RetryLater(volume_id, std::move(again));
  }
  repairs_.Began(volume_id);
  const absl::Time since = absl::Now();
  LOG(WARNING) << "volume " << volume_id << ": " << why << "; re-binding its pod targets";
  state::Volume v = *found;
  if (adopt_global) {
    // Stacked on the global mount's base (that is where pod targets follow it from): the base
    // stays the base.
    if (!v.has_staging_base()) *v.mutable_staging_base() = v.staging_mount();
    *v.mutable_staging_mount() = *adopt_global;
    v.set_source_dev_major(adopt_global->dev_major());
    v.set_source_dev_minor(adopt_global->dev_minor());
  }
  KindJob job{"recovery: re-bind targets",
              [this, ctx = host_.ops_context(), v = std::move(v), adopt = adopt_global.has_value(), volume_id,
               since]() -> absl::StatusOr<AdoptFn> {
                if (adopt) {
                  if (auto s = ctx.store->SaveBlocking(v); !s.ok()) return s;
                }
                auto rebound = RebindTargetsBlocking(ctx, v);
                if (!rebound.ok()) return rebound.status();
                return AdoptFn([this, r = std::make_shared<RebindOutcome>(std::move(*rebound)), volume_id, since] {
                  repairs_.Succeeded(volume_id);
                  ReportRebind(*r);
                  if (!r->failed.empty()) {
                    host_.RecoveryFinished("re-bind", "failed", absl::Now() - since);
                  } else if (!r->rebound.empty()) {
                    // After the new state is recorded: Verify reads it.
                    host_.loop().Post([this, volume_id, since] { Verify(volume_id, "re-bind", since); });
                  }
                  return VolumeChange::Set(r->volume);
                });
              }};
  host_.RunClaimed(std::move(claim), std::move(job), [this, volume_id, why, adopt_global](absl::Status s) {
    if (s.ok()) return;
    repairs_.Failed(volume_id);
    LOG(ERROR) << "volume " << volume_id << ": re-binding targets failed: " << s;
    repairs_.RetryLater(volume_id, [this, volume_id, why, adopt_global] { Rebind(volume_id, why, adopt_global); });
  });
}

bool FuseKind::Audit(const MountTable& table, const state::Volume& v, const std::string& why) {
  const std::string& id = v.volume_id();
  if (repairs_.running(id)) return true;
  if (host_.Busy(id)) return false;
  const KubeletDir& kubelet = *host_.ops_context().kubelet;
  if (!v.staging_path().empty()) {
    if (v.staging_pending()) return true;
    const MountEntry* global = table.FindTop(kubelet.MountTablePath(v.staging_path()));
    if (global == nullptr) {
      RepairFuse(id, absl::StrCat(why, ": the global mount at ", v.staging_path(), " is gone"));
      return true;
    }
    if (!SameDev(global, v.staging_mount())) {
      state::MountIdentity adopted;
      adopted.set_dev_major(global->major);
      adopted.set_dev_minor(global->minor);
      adopted.set_root(std::string(global->root));
      Rebind(id, absl::StrCat(why, ": the global mount at ", v.staging_path(), " was replaced (", global->fs_type, ")"),
             adopted);
      return true;
    }
    for (const auto& t : v.targets()) {
      if (t.pending()) continue;
      if (!SameDev(table.FindTop(kubelet.MountTablePath(t.path())), v.staging_mount())) {
        Rebind(id, absl::StrCat(why, ": ", t.path(), " is not bound to the global mount"), std::nullopt);
        break;
      }
    }
  } else if (v.targets_size() == 1 && !v.targets(0).pending()) {
    const MountEntry* top = table.FindTop(kubelet.MountTablePath(v.targets(0).path()));
    if (top == nullptr) {
      RepairFuse(id, absl::StrCat(why, ": the FUSE mount at ", v.targets(0).path(), " is gone"));
    } else if (!SameDev(top, v.targets(0).mount())) {
      // Its live layer was removed, leaving the (dead) base on top.
      RepairFuse(id, absl::StrCat(why, ": the FUSE mount at ", v.targets(0).path(),
                                  " is no longer the live connection"));
    } else if (SocketHidden(table, v)) {
      return MakeSocketAgain(v);
    }
  }
  return true;
}

void FuseKind::ContainerRestarted(const state::Volume& v, const std::string& pod_uid, const std::string& container) {
  LOG(INFO) << "volume " << v.volume_id() << ": the kubelet reports container " << container << " of pod " << pod_uid
            << " restarted";
  FuseEndpoint* ep = endpoints_.Find(v.volume_id(), FuseMountPath(v));
  if (ep != nullptr && ep->recovering_since == absl::InfinitePast() &&
      !ep->endpoint->serving()) {
    ep->recovering_since = absl::Now();
    ep->recovering_how = "server restart";
  }
}

void FuseKind::Count(const state::Volume& v, VolumeCounts* c) const {
  std::string state;
  const FuseEndpoint* ep = endpoints_.Find(v.volume_id(), FuseMountPath(v));
  if (repairs_.running(v.volume_id())) {
    state = "repairing";
    ++c->repairs_in_progress;
  } else if (ep == nullptr && restoring_.count(v.volume_id()) > 0) {
    state = "awaiting_redeposit";  // its socket is being made again after an agent restart
  } else if (ep == nullptr) {
    state = "unwatched";
  } else if (ep->endpoint->serving()) {
    state = "serving";
    if (ep->relayed) ++c->relayed;
    c->passthrough_held += static_cast<int64_t>(ep->endpoint->backing_files_held());
  } else if (ep->endpoint->awaiting_redeposit()) {
    state = "awaiting_redeposit";  // mounted before an agent restart; its server has not re-deposited
  } else if (ep->endpoint->served()) {
    state = "server_gone";
  } else {
    state = "waiting_for_server";
    ++c->handoffs_waiting;
  }
  ++c->volumes_by_kind_state[absl::StrCat(kFuseKind, "/", state)];
}

void FuseKind::CountKind(VolumeCounts* c) const {
  c->servers_not_answering += servers_not_answering_;
  c->fuse_tunings_applied += tunings_applied_;
  c->fuse_tunings_failed += tunings_failed_;
  c->passthrough_registered += broker_.stats().registered;
  c->passthrough_refused += broker_.stats().refused;
  c->passthrough_closed += broker_.stats().closed;
}

}  // namespace fusekeeper
