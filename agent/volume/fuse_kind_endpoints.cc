// FuseKind: each volume's handoff endpoints (started, stopped, their server pods' listeners),
// and the deadlines on them (the handoff, the server's first answers).
#include "agent/volume/fuse_kind.h"

#include "absl/strings/str_cat.h"
#include "agent/fuse/fuse_tuning.h"
#include "agent/serverpod/server_spec.h"
#include "agent/volume/mount_stack.h"
#include "agent/volume/state_store.h"
#include "agent/volume/volume_spec.h"
#include "glog/logging.h"

namespace fusekeeper {

namespace {

// What the server is handed with the mount at `path` of `v`.
MountConfig HandoffConfig(const state::Volume& v, const std::string& path,
                          const std::map<std::string, std::string>& secrets,
                          const std::vector<std::string>& mount_options) {
  MountConfig config;
  config.volume_id = v.volume_id();
  config.uid = v.fuse().server_uid();
  config.gid = v.fuse().server_gid();
  if (v.fuse().has_mount_group()) config.mount_group = v.fuse().mount_group();
  config.read_only = v.fuse().read_only();
  for (const auto& t : v.targets()) {
    if (t.path() == path) config.read_only = config.read_only || t.readonly();
  }
  config.mount_options = mount_options;
  for (const auto& [k, val] : v.volume_context()) config.volume_context[k] = val;
  if (v.fuse().pass_secrets()) config.secrets = secrets;
  return config;
}

HandoffOptions HandoffOptionsFor(const FuseKindOptions& o, const state::Volume& v, const std::string& path,
                                 BackingBroker* broker) {
  HandoffOptions ho;
  ho.broker = broker;
  ho.reply_timeout = o.handoff_reply_timeout;
  ho.peer_uid = v.fuse().server_uid();
  ho.redeposit_wait = o.redeposit_wait;
  if (o.server_pods != nullptr) ho.drain_wait = absl::Milliseconds(o.server_pods->settings().drain_ms);
  // A server re-depositing the connection after an agent restart must hand back this mount's.
  ho.expected_connection = MountsAt(v, path).top.dev_minor();
  return ho;
}

}  // namespace

void FuseKind::StartEndpoint(const state::Volume& v, const std::string& path, UniqueFd fuse_fd, HandoffSocket socket,
                             const std::map<std::string, std::string>& secrets,
                             const std::vector<std::string>& mount_options, bool unclaimed_timeout) {
  const std::string vid = v.volume_id();
  StopEndpoint(vid, path);
  FuseEndpoint& e = endpoints_.Add(vid, path);
  e.socket_dir_major = socket.dir_major;
  e.socket_dir_minor = socket.dir_minor;
  e.endpoint = HandoffEndpoint::Start(host_.loop(), std::move(socket.listen_fd), std::move(fuse_fd),
                                      HandoffConfig(v, path, secrets, mount_options),
                                      HandoffOptionsFor(options_, v, path, &broker_), HandoffEvents(vid, path));
  if (unclaimed_timeout) {
    e.handoff_deadline.Arm(absl::ToChronoNanoseconds(options_.handoff_timeout),
                           [this, vid, path] { OnHandoffTimeout(vid, path); });
  }
  LOG(INFO) << "volume " << vid << ": FUSE mount at " << path << " waits for its server on " << v.fuse().socket_path();
  // Its server pods' sockets, as more listeners of this endpoint: once the work that started it
  // has recorded the volume and ended its claim.
  if (path == v.staging_path() && options_.server_pods != nullptr) {
    for (const std::string& uid : options_.server_pods->PodUids(vid)) {
      host_.loop().Post([this, vid, uid] { AttachPodListener(vid, uid, options_.pod_dir_retry); });
    }
  }
}

HandoffEndpoint::Events FuseKind::HandoffEvents(const std::string& vid, const std::string& path) {
  HandoffEndpoint::Events events;
  events.on_served = [this, vid, path](const HandoffReply& reply, pid_t pid) {
    FuseEndpoint* e = endpoints_.Find(vid, path);
    if (e == nullptr) return;
    e->relayed = reply.relayed;
    e->handoff_deadline.Cancel();
    const bool adopted = e->endpoint->adoptions() > e->adoptions_seen;
    e->adoptions_seen = e->endpoint->adoptions();
    // A connection no server has initialised yet (not adopted, not handed back after an agent
    // restart): until its server answers FUSE_INIT every access to the mount waits.
    if (!adopted && !reply.redeposit) {
      StartAnswerProbe(*e, vid, path,
                       absl::StrCat(reply.server.empty() ? "a server that did not name itself" : reply.server,
                                    pid > 0 ? absl::StrCat(", pid ", pid) : ""));
    }
    OnServed(vid, path, adopted);
    // A re-deposit after an agent restart with a new pod's server on standby: the roll it held
    // back can go on now.
    if (options_.server_pods != nullptr && e->endpoint->standby() > 0) options_.server_pods->ResyncSoon();
  };
  events.on_server_gone = [this, vid, path](const absl::Status& why) {
    OnServerGone(vid, path, why);
    // Its server pod may have been deleted: made again without waiting for the next resync.
    if (options_.server_pods != nullptr && options_.server_pods->wanted().count(vid) > 0) {
      options_.server_pods->ResyncSoon();
    }
  };
  events.on_fresh_requested = [this, vid] {
    RepairFuse(vid, "its restarted FUSE server cannot adopt the live connection and asked for a fresh one");
  };
  events.on_backing_refused = [this, vid](const std::string& why) {
    if (const state::Volume* v = host_.Find(vid); v != nullptr) {
      host_.Event(*v, "Warning", "PassthroughRefused",
                  absl::StrCat("volume ", vid, ": the agent refused to register a file of its FUSE server for "
                               "passthrough (", why, "); such files are served through the server, slower"));
    }
  };
  events.on_server_notice = [this, vid](const HandoffReply& notice) {
    if (const state::Volume* v = host_.Find(vid); v != nullptr) {
      host_.Event(*v, "Warning", "FuseServerNotice",
                  absl::StrCat("volume ", vid, ": its FUSE server reports: ", notice.notice));
    }
    // A relayed program that died and was started again, the connection kept: a recovery the
    // server made by itself.
    if (notice.restart_ms >= 0) {
      host_.RecoveryFinished("program restart (relayed)", "recovered", absl::Milliseconds(notice.restart_ms));
    }
  };
  events.on_connection_aborted = [this, vid, path] {
    const FuseEndpoint* e = endpoints_.Find(vid, path);
    if (e != nullptr && e->gave_up) return;  // a server that connects gets a fresh one
    RepairFuse(vid, "its FUSE connection was aborted");
  };
  if (options_.server_pods != nullptr) {
    // A new server pod's server waits to take over (a roll): the old pod can go now.
    events.on_standby = [this](const std::string&) { options_.server_pods->ResyncSoon(); };
    // Its pod is going (deleted, evicted): the successor is made now, and the server stops once
    // that one's server waits.
    events.on_draining = [this, vid] {
      if (const state::Volume* v = host_.Find(vid); v != nullptr) {
        host_.Event(*v, "Normal", "ServerDraining",
                    absl::StrCat("volume ", vid, ": its server pod's server was asked to stop (pod deleted or "
                                 "evicted); it serves on until its successor on this node is ready"));
      }
      options_.server_pods->ResyncSoon();
    };
  }
  return events;
}

bool FuseKind::SocketHidden(const MountTable& table, const state::Volume& v) const {
  const std::string& socket = v.fuse().socket_path();
  const FuseEndpoint* ep = endpoints_.Find(v.volume_id(), FuseMountPath(v));
  if (ep == nullptr || socket.empty() || remaking_socket_.count(v.volume_id()) > 0) return false;
  const std::string dir = socket.substr(0, socket.rfind('/'));
  const MountEntry* top = table.FindTop(host_.ops_context().kubelet->MountTablePath(dir));
  return top != nullptr && (top->major != ep->socket_dir_major || top->minor != ep->socket_dir_minor);
}

bool FuseKind::MakeSocketAgain(const state::Volume& v) {
  const std::string vid = v.volume_id();
  ClaimQueue::Claim claim = host_.TryClaim(vid);
  if (!claim) return false;
  const std::string path = FuseMountPath(v);
  LOG(WARNING) << "volume " << vid << ": its handoff socket " << v.fuse().socket_path()
               << " is hidden by a mount made on its directory since (a Memory emptyDir's tmpfs); making it again "
                  "on top, where the server looks";
  remaking_socket_.insert(vid);
  host_.RunClaimed(
      std::move(claim),
      KindJob{"handoff socket made again over a mount",
              [this, ctx = host_.ops_context(), v, vid, path]() -> absl::StatusOr<AdoptFn> {
                auto socket = ListenForServerBlocking(ctx, v);
                if (!socket.ok()) return socket.status();
                return AdoptFn([this, vid, path, s = std::make_shared<HandoffSocket>(std::move(*socket))] {
                  FuseEndpoint* ep = endpoints_.Find(vid, path);
                  if (ep == nullptr) return VolumeChange::Keep();  // torn down meanwhile
                  ep->socket_dir_major = s->dir_major;
                  ep->socket_dir_minor = s->dir_minor;
                  ep->endpoint->AddListener(std::move(s->listen_fd), "");
                  LOG(INFO) << "volume " << vid << ": handoff socket made again; its server can connect";
                  return VolumeChange::Keep();
                });
              }},
      [this, vid](absl::Status s) {
        remaking_socket_.erase(vid);
        if (s.ok()) return;
        const state::Volume* now = host_.Find(vid);
        if (now == nullptr) return;
        host_.Event(*now, "Warning", "HandoffSocketHidden",
                    absl::StrCat("volume ", vid, ": its handoff socket is hidden by a mount made on its directory "
                                 "and cannot be made again (", s.message(), "); its FUSE server cannot connect"));
      });
  return true;
}

void FuseKind::OnServerPod(const std::string& volume_id, const std::string& pod_name, const std::string& pod_uid) {
  LOG(INFO) << "volume " << volume_id << ": server pod " << pod_name << " (uid " << pod_uid << ") exists";
  AttachPodListener(volume_id, pod_uid, options_.pod_dir_retry);
}

void FuseKind::OnServerPodGone(const std::string& volume_id, const std::string& pod_name,
                               const std::string& pod_uid) {
  LOG(INFO) << "volume " << volume_id << ": server pod " << pod_name << " (uid " << pod_uid << ") is gone";
  pod_dir_waited_.erase(pod_uid);
  const state::Volume* v = host_.Find(volume_id);
  if (v == nullptr) return;
  FuseEndpoint* e = endpoints_.Find(volume_id, v->staging_path());
  if (e != nullptr) e->endpoint->RemoveListener(pod_uid);
}

bool FuseKind::ServerWaitsFrom(const std::string& volume_id, const std::string& pod_uid) const {
  const state::Volume* v = host_.Find(volume_id);
  if (v == nullptr) return false;
  const FuseEndpoint* ep = endpoints_.Find(volume_id, v->staging_path());
  if (ep == nullptr) return false;
  // After an agent restart the live connection is held only by the serving pod's server until
  // it re-deposits it: its pod must not go before that, or the connection goes with it (and
  // every open file and working directory in the pods with the connection).
  if (ep->endpoint->awaiting_redeposit()) return false;
  return ep->endpoint->HasServerFrom(pod_uid);
}

void FuseKind::AttachPodListener(const std::string& volume_id, const std::string& pod_uid, absl::Duration retry) {
  if (!options_.server_pods->HasPod(volume_id, pod_uid)) return;  // gone meanwhile
  const state::Volume* v = host_.Find(volume_id);
  if (v == nullptr || v->staging_path().empty()) return;  // staged yet? StartEndpoint attaches then
  const std::string path = v->staging_path();
  const FuseEndpoint* ep = endpoints_.Find(volume_id, path);
  if (ep == nullptr) return;
  const uint64_t serial = ep->serial;
  // The kubelet makes the directory as it starts the pod, usually within seconds: looked for
  // every pod_dir_retry for the first 10 s (a stat each), then less and less often.
  auto again = [this, volume_id, pod_uid, retry] {
    later_.Add(absl::ToChronoNanoseconds(retry), [this, volume_id, pod_uid, retry] {
      auto& waited = pod_dir_waited_[pod_uid];
      waited += retry;
      const absl::Duration next =
          waited < absl::Seconds(10) ? options_.pod_dir_retry : std::min(retry * 2, options_.max_pod_dir_retry);
      AttachPodListener(volume_id, pod_uid, next);
    });
  };
  ClaimQueue::Claim claim = host_.TryClaim(volume_id);
  if (!claim) return again();
  host_.RunClaimed(
      std::move(claim),
      KindJob{"listen in a server pod's emptyDir",
              [this, ctx = host_.ops_context(), v = *v, pod_uid, path, serial]() -> absl::StatusOr<AdoptFn> {
                auto listen = ListenInServerPodBlocking(ctx, v, pod_uid, kHandoffVolume, kHandoffSocketName);
                if (!listen.ok()) return listen.status();
                return AdoptFn([this, volume_id = v.volume_id(), pod_uid, path, serial,
                                fd = std::make_shared<UniqueFd>(std::move(*listen))] {
                  FuseEndpoint* ep = endpoints_.Find(volume_id, path, serial);
                  if (ep != nullptr && options_.server_pods->HasPod(volume_id, pod_uid)) {
                    ep->endpoint->AddListener(std::move(*fd), pod_uid);
                  }
                  pod_dir_waited_.erase(pod_uid);
                  return VolumeChange::Keep();
                });
              }},
      [volume_id, pod_uid, again](absl::Status s) mutable {
        if (s.ok()) return;
        if (s.code() != absl::StatusCode::kNotFound) {
          LOG(WARNING) << "volume " << volume_id << ": cannot listen in server pod " << pod_uid
                       << "'s emptyDir: " << s;
        }
        again();  // the kubelet has not made it yet
      });
}

void FuseKind::StopEndpoint(const std::string& volume_id, const std::string& path) {
  std::unique_ptr<FuseEndpoint> e = endpoints_.Take(volume_id, path);
  if (e == nullptr) return;
  e->StopAnswerProbe();
  if (e->gone_pending > 0) {
    LOG(INFO) << "volume " << volume_id << ": its FUSE server stopped as the volume was unpublished at " << path
              << " (a pod going away): no Warning";
  }
  e->endpoint->Stop();
}

void FuseKind::OnHandoffTimeout(const std::string& volume_id, const std::string& path) {
  FuseEndpoint* ep = endpoints_.Find(volume_id, path);
  // A server serves it now: nothing to give up on (also when this timer was armed as an earlier
  // server stopped, and another has taken the volume since).
  if (ep == nullptr || ep->endpoint->serving() || ep->gave_up) return;
  const state::Volume* v = host_.Find(volume_id);
  if (v == nullptr) return;
  ClaimQueue::Claim claim = host_.TryClaim(volume_id);
  if (!claim) {
    // An RPC on this volume is in progress; look again shortly.
    ep->handoff_deadline.Arm(std::chrono::seconds(1), [this, volume_id, path] { OnHandoffTimeout(volume_id, path); });
    return;
  }
  // The mount stays a mount: unmounting it would leave the pod writing to a plain directory on
  // the node's disk. Its connection is aborted instead, so that everything waiting on it (a
  // container being created stats its mounts) fails fast with ENOTCONN, and the endpoint keeps
  // listening: a server that connects later gets a fresh connection stacked on this mount.
  const bool was_served = ep->endpoint->served();
  const std::string message =
      was_served
          // A server took the volume and stopped (a program that dies before it answers FUSE_INIT
          // would leave the pod's reads waiting forever): the same bound as for a server that
          // never comes.
          ? absl::StrCat("the FUSE server stopped (", ep->gone_reason, ") and no server served volume ",
                         volume_id, " again within ", absl::FormatDuration(options_.handoff_timeout),
                         "; the mount now fails fast (ENOTCONN) until one does")
          : absl::StrCat("no FUSE server connected to ", v->fuse().socket_path(), " within ",
                         absl::FormatDuration(options_.handoff_timeout),
                         "; the mount now fails fast (ENOTCONN) until one does. Check that the server (sidecar or "
                         "node-level) runs as uid ",
                         v->fuse().server_uid(), ", that it is given that socket path",
                         v->staging_path().empty() ? " (the pod's emptyDir named in volume_context socketVolume)" : "",
                         ", and its logs");
  GiveUpOnConnection(*ep, *v, path, std::move(claim),
                     was_served ? "FuseServerNotServing" : "FuseServerNeverConnected", message,
                     "handoff timeout: abort the unserved connection");
}

void FuseKind::GiveUpOnConnection(FuseEndpoint& e, const state::Volume& v, const std::string& path,
                                  ClaimQueue::Claim claim, const char* reason, const std::string& message,
                                  const char* job) {
  e.gave_up = true;
  e.endpoint->ExpectAbort();
  e.gone_reason = message;
  host_.Event(v, "Warning", reason, message);
  const PathMounts mounts = MountsAt(v, path);
  host_.RunClaimed(std::move(claim),
                   KindJob{job,
                           [ctx = host_.ops_context(), path, mounts]() -> absl::StatusOr<AdoptFn> {
                             AbortConnectionsAtBlocking(*ctx.kubelet, path,
                                                        {mounts.top.dev_minor(), mounts.base.dev_minor()});
                             return AdoptFn([] { return VolumeChange::Keep(); });
                           }},
                   nullptr);
}

void FuseKind::StartAnswerProbe(FuseEndpoint& e, const std::string& volume_id, const std::string& path,
                                std::string server) {
  e.StopAnswerProbe();
  const state::Volume* v = host_.Find(volume_id);
  const bool tune = v != nullptr && HasFuseTuning(v->fuse());
  // Asked when there is a deadline for the answer, or tuning that must wait for it.
  if (options_.init_timeout <= absl::ZeroDuration() && !tune) return;
  e.answer_server = std::move(server);
  const uint64_t serial = e.serial;
  const absl::Time asked = absl::Now();
  e.answer_probe = AnswerProbe::Start(host_.loop(), path, [this, path, serial, asked, volume_id](int32_t res) {
    FuseEndpoint* ep = endpoints_.Find(volume_id, path, serial);
    if (ep == nullptr) return;
    ep->init_deadline.Cancel();
    ep->answer_probe.reset();
    // Any answer counts, an error too (a server that refused FUSE_INIT does answer). ENOTCONN:
    // the connection was aborted meanwhile (a repair, or the kernel), which its own event reports.
    const std::string after = absl::FormatDuration(absl::Trunc(absl::Now() - asked, absl::Milliseconds(1)));
    if (res == -ENOTCONN) {
      LOG(INFO) << "volume " << volume_id << ": its FUSE connection was aborted " << after << " after the handoff, "
                << "before its server (" << ep->answer_server << ") had answered";
    } else {
      LOG(INFO) << "volume " << volume_id << ": its FUSE server (" << ep->answer_server
                << ") answered the kernel's first requests" << (res < 0 ? absl::StrCat(" (", strerror(-res), ")") : "")
                << " " << after << " after the handoff";
      // The server's INIT reply has set the connection's limits: now ours hold.
      if (res != -ECANCELED) Tune(volume_id, path, serial);
    }
  });
  if (options_.init_timeout > absl::ZeroDuration()) {
    e.init_deadline.Arm(absl::ToChronoNanoseconds(options_.init_timeout),
                        [this, volume_id, path] { OnInitTimeout(volume_id, path); });
  }
}

void FuseKind::Tune(const std::string& volume_id, const std::string& path, uint64_t serial) {
  const state::Volume* v = host_.Find(volume_id);
  FuseEndpoint* e = endpoints_.Find(volume_id, path, serial);
  if (v == nullptr || e == nullptr || !HasFuseTuning(v->fuse())) return;
  ClaimQueue::Claim claim = host_.TryClaim(volume_id);
  if (!claim) {
    // An RPC on the volume is in flight (it may be tearing the connection down): after it.
    e->tune_retry.Arm(std::chrono::milliseconds(200), [this, volume_id, path, serial] { Tune(volume_id, path, serial); });
    return;
  }
  const uint32_t minor = MountsAt(*v, path).top.dev_minor();
  const std::string tuning = DescribeFuseTuning(v->fuse());
  host_.RunClaimed(std::move(claim),
                   KindJob{"tune the FUSE connection",
                           [fuse = v->fuse(), minor]() -> absl::StatusOr<AdoptFn> {
                             if (auto s = ApplyFuseTuningBlocking(minor, fuse); !s.ok()) return s;
                             return AdoptFn([] { return VolumeChange::Keep(); });
                           }},
                   [this, volume_id, path, tuning](absl::Status s) {
                     if (s.ok()) {
                       ++tunings_applied_;
                       LOG(INFO) << "volume " << volume_id << ": FUSE connection at " << path << " tuned: " << tuning;
                       return;
                     }
                     ++tunings_failed_;
                     if (const state::Volume* v = host_.Find(volume_id); v != nullptr) {
                       host_.Event(*v, "Warning", "FuseTuningFailed",
                                   absl::StrCat("volume ", volume_id, ": ", tuning, " could not be applied to its FUSE "
                                                "connection: ", s.message(), "; it is served with the kernel's values"));
                     }
                   });
}

void FuseKind::OnInitTimeout(const std::string& volume_id, const std::string& path) {
  FuseEndpoint* ep = endpoints_.Find(volume_id, path);
  if (ep == nullptr) return;
  // Answered meanwhile (the probe's end cancels this timer, unless it came during a retry).
  if (ep->answer_probe == nullptr || !ep->answer_probe->pending()) return;
  const state::Volume* v = host_.Find(volume_id);
  if (v == nullptr) return;
  ClaimQueue::Claim claim = host_.TryClaim(volume_id);
  if (!claim) {
    // An RPC on this volume is in progress (an unstage aborts the connection itself); look
    // again shortly.
    ep->init_deadline.Arm(std::chrono::seconds(1), [this, volume_id, path] { OnInitTimeout(volume_id, path); });
    return;
  }
  const std::string server = ep->answer_server;
  ep->StopAnswerProbe();  // the abort ends it (ENOTCONN): nothing more to learn from it
  // As for a server that never came (OnHandoffTimeout): the mount stays, its connection is
  // aborted so that everything waiting on it (kubelet's checks too) fails fast, and the next
  // server that connects gets a fresh connection stacked on the mount.
  ++servers_not_answering_;
  const std::string message = absl::StrCat(
      "its FUSE server (", server, ") took the connection of volume ", volume_id, " and did not answer the kernel's "
      "first requests (FUSE_INIT, then a GETATTR of the mount's root) within ", absl::FormatDuration(options_.init_timeout),
      "; the connection was aborted, so the mount fails fast (ENOTCONN) instead of hanging, until a server that "
      "answers connects to ", v->fuse().socket_path(), " (it gets a fresh connection). Check that the server "
      "serves the fd it was handed (a launched program: /dev/fd/{fd} or {mountpoint}) and its logs");
  GiveUpOnConnection(*ep, *v, path, std::move(claim), "FuseServerNotAnswering", message,
                     "init timeout: abort the connection its server does not answer");
}

}  // namespace fusekeeper
