#include "agent/volume/fuse_kind.h"

#include "absl/strings/str_cat.h"
#include "agent/serverpod/server_spec.h"
#include "agent/volume/mount_stack.h"
#include "agent/volume/state_store.h"
#include "agent/volume/volume_spec.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

using csi::v1::VolumeCapability;

constexpr char kDefaultSocketName[] = "fusekeeper.sock";

// volume_context keys this kind reads itself; every other key is handed to the FUSE server.
bool IsAgentKey(const std::string& k) {
  return k == "kind" || k == "serverUid" || k == "serverGid" || k == "subtype" || k == "socketVolume" ||
         k == "socketName" || k == "passSecrets" || IsServerPodKey(k);
}

// Mount flags for a FUSE volume: a few kernel options are honoured (ro, noexec, noatime,
// max_read=N); options the agent itself sets (fd, rootmode, user_id, group_id, ...) are refused,
// as is a comma inside a flag (an attempt to smuggle more options); everything else goes to the
// server. Flags are named by position only in errors: they may carry secrets.
absl::Status ParseFuseMountFlags(const VolumeCapability& cap, state::Fuse* fuse,
                                 std::vector<std::string>* for_server) {
  static const char* const kReserved[] = {"fd", "rootmode", "user_id", "group_id", "blksize",
                                          "allow_other", "default_permissions", "source", "subtype",
                                          "suid", "dev"};
  const auto& flags = cap.mount().mount_flags();
  for (int i = 0; i < flags.size(); ++i) {
    const std::string& f = flags[i];
    const std::string key = f.substr(0, f.find('='));
    if (f.find(',') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mount flag #", i + 1, " contains ','; give each option as a separate flag"));
    }
    for (const char* r : kReserved) {
      if (key == r) {
        return absl::InvalidArgumentError(absl::StrCat(
            "mount flag #", i + 1, " sets '", key, "', which fusekeeper controls for FUSE volumes"));
      }
    }
    if (f == "ro") {
      fuse->set_read_only(true);
    } else if (f == "rw") {
    } else if (f == "noexec") {
      fuse->set_noexec(true);
    } else if (f == "noatime") {
      fuse->set_noatime(true);
    } else if (key == "max_read") {
      auto v = ParseId(f.substr(key.size() + 1 < f.size() ? key.size() + 1 : f.size()),
                       absl::StrCat("mount flag #", i + 1, " max_read"));
      if (!v.ok() || *v == 0) {
        return absl::InvalidArgumentError(absl::StrCat("mount flag #", i + 1, " max_read needs a positive number"));
      }
      fuse->set_max_read(*v);
    } else if (for_server != nullptr) {
      for_server->push_back(f);
    }
  }
  return absl::OkStatus();
}

// What a FUSE server is handed besides the volume's config: the request's secrets and the mount
// flags the kernel does not take (validated earlier, in ParseSpec).
template <typename Request>
std::pair<std::map<std::string, std::string>, std::vector<std::string>> ServerInputs(const Request& req) {
  std::map<std::string, std::string> secrets(req.secrets().begin(), req.secrets().end());
  std::vector<std::string> options;
  state::Fuse unused;
  (void)ParseFuseMountFlags(req.volume_capability(), &unused, &options);
  return {std::move(secrets), std::move(options)};
}

// A staged FUSE volume is one mount whose server presents every file with the group it was
// staged with; a pod whose fsGroup differs would get files it may not write, and kubelet (the
// driver advertises VOLUME_MOUNT_GROUP) does not chown. So such a publish is refused, naming
// both groups, instead of succeeding silently.
absl::Status CheckStagedMountGroup(const state::Volume& v, const VolumeCapability& cap) {
  const std::string& asked = cap.mount().volume_mount_group();
  if (asked.empty()) return absl::OkStatus();  // no fsGroup: nothing promised
  auto g = ParseId(asked, "volume_mount_group");
  if (!g.ok()) return g.status();
  if (v.fuse().has_mount_group() && v.fuse().mount_group() == *g) return absl::OkStatus();
  const std::string staged = v.fuse().has_mount_group()
                                 ? absl::StrCat("fsGroup ", v.fuse().mount_group())
                                 : absl::StrCat("no fsGroup (files show the server's group ", v.fuse().server_gid(), ")");
  return absl::FailedPreconditionError(absl::StrCat(
      "volume ", v.volume_id(), " is staged on this node with ", staged, ", and its FUSE server presents every "
      "file with that group to every pod; this pod asks for fsGroup ", *g, ". Pods that share a staged FUSE volume "
      "on a node must use the same fsGroup (or none)"));
}

// The bind of a staged volume's global mount onto a pod's target. Kubelet passes the PV's mount
// options to NodePublishVolume as it did to NodeStageVolume; those went to the mount (and its
// server) at stage time, so here only the ones a bind can honour count: read-only (the flag, the
// request or a reader-only access mode) and noexec. FUSE mounts are nosuid and nodev already.
BindOptions StagedTargetBind(const csi::v1::NodePublishVolumeRequest& req) {
  BindOptions o;
  o.read_only = ReadOnlyRequested(req.volume_capability(), req.readonly());
  for (const auto& f : req.volume_capability().mount().mount_flags()) {
    if (f == "ro") o.read_only = true;
    if (f == "noexec") o.noexec = true;
  }
  o.nosuid = o.nodev = true;
  return o;
}

}  // namespace

FuseKind::FuseKind(VolumeHost& host, FuseKindOptions options) : VolumeKind(host), options_(std::move(options)) {
  if (options_.server_pods == nullptr) return;
  ServerPods::Events ev;
  ev.on_pod = [this](const std::string& vid, const std::string& name, const std::string& uid) {
    OnServerPod(vid, name, uid);
  };
  ev.on_pod_gone = [this](const std::string& vid, const std::string& name, const std::string& uid) {
    OnServerPodGone(vid, name, uid);
  };
  ev.on_event = [this](const std::string& vid, const std::string& type, const std::string& reason,
                       const std::string& message) {
    if (const state::Volume* v = host_.Find(vid); v != nullptr) {
      host_.Event(*v, type, reason, message);
    } else {
      LOG(INFO) << reason << ": " << message;
    }
  };
  ev.standby_ready = [this](const std::string& vid, const std::string& uid) { return ServerWaitsFrom(vid, uid); };
  options_.server_pods->SetEvents(std::move(ev));
}

absl::Status FuseKind::ParseSpec(const google::protobuf::Map<std::string, std::string>& ctx,
                                 const VolumeCapability& cap, bool staged, state::Spec* spec) const {
  if (auto s = ParseFuseSpec(ctx, cap, spec); !s.ok()) return s;
  if (DeclaresServerPod(ctx) && !staged) {
    return absl::InvalidArgumentError(
        "volume_context.serverImage declares a server pod, which only staged volumes (PersistentVolumes) get; "
        "an inline volume is served by its pod's sidecar (socketVolume)");
  }
  state::Fuse& fuse = *spec->mutable_fuse();
  return ParseServerPod(ctx, ctx.count("serverUid") > 0, fuse.server_uid(), fuse.server_gid(),
                        fuse.mutable_server_pod());
}

absl::Status ParseFuseSpec(const google::protobuf::Map<std::string, std::string>& ctx, const VolumeCapability& cap,
                           state::Spec* spec) {
  state::Fuse& fuse = *spec->mutable_fuse();
  const std::string subtype = ContextValue(ctx, "subtype");
  fuse.set_subtype(subtype.empty() ? "fusekeeper" : subtype);
  if (fuse.subtype().find_first_of(",= \t\n/") != std::string::npos || fuse.subtype().size() > 64) {
    return absl::InvalidArgumentError(absl::StrCat("volume_context.subtype '", fuse.subtype(), "' is not valid"));
  }
  const std::string uid = ContextValue(ctx, "serverUid"), gid = ContextValue(ctx, "serverGid");
  if (!uid.empty()) {
    auto u = ParseId(uid, "volume_context.serverUid");
    if (!u.ok()) return u.status();
    fuse.set_server_uid(*u);
  }
  if (!gid.empty() || !uid.empty()) {
    auto g = ParseId(gid.empty() ? uid : gid, "volume_context.serverGid");
    if (!g.ok()) return g.status();
    fuse.set_server_gid(*g);
  }
  const std::string& group = cap.mount().volume_mount_group();
  if (!group.empty()) {
    auto g = ParseId(group, "volume_mount_group");
    if (!g.ok()) return g.status();
    fuse.set_has_mount_group(true);
    fuse.set_mount_group(*g);
  }
  fuse.set_pass_secrets(ContextValue(ctx, "passSecrets") == "true");
  if (auto s = ParseFuseMountFlags(cap, &fuse, nullptr); !s.ok()) return s;
  const std::string socket_name = ContextValue(ctx, "socketName");
  if (!socket_name.empty()) {
    if (auto s = CheckName(socket_name, "volume_context.socketName"); !s.ok()) return s;
  }
  for (const auto& [k, v] : ctx) {
    if (!IsAgentKey(k)) (*spec->mutable_volume_context())[k] = v;
  }
  return absl::OkStatus();
}

void FuseKind::ApplySpec(const state::Spec& spec, state::Volume* v) const {
  v->set_kind(kFuseKind);
  v->clear_host_path();
  v->clear_host_path_type();
  const std::string socket_path = v->fuse().socket_path();
  *v->mutable_fuse() = spec.fuse();
  v->mutable_fuse()->set_socket_path(socket_path);
  v->clear_volume_context();
  for (const auto& [k, val] : spec.volume_context()) (*v->mutable_volume_context())[k] = val;
}

std::string FuseKind::EndpointKey(const std::string& volume_id, const std::string& path) {
  return absl::StrCat(volume_id, "\n", path);
}

KindJob FuseKind::MountJob(std::string reason, state::Volume v, int target_index,
                           std::optional<state::Volume> previous, bool socket_in_kubelet_dir,
                           std::map<std::string, std::string> secrets, std::vector<std::string> server_options) {
  const std::string path = target_index < 0 ? v.staging_path() : v.targets(target_index).path();
  return KindJob{
      std::move(reason),
      [this, ctx = host_.ops_context(), v = std::move(v), target_index, previous = std::move(previous),
       socket_in_kubelet_dir, secrets = std::move(secrets), server_options = std::move(server_options),
       path]() mutable -> absl::StatusOr<AdoptFn> {
        auto m = MountFuseVolumeBlocking(ctx, std::move(v), target_index, std::move(previous), socket_in_kubelet_dir);
        if (!m.ok()) return m.status();
        return AdoptFn([this, m = std::make_shared<FuseMounted>(std::move(*m)), path,
                        secrets = std::move(secrets), server_options = std::move(server_options)] {
          StartEndpoint(m->volume, path, std::move(m->fuse_fd), std::move(m->listen_fd), secrets, server_options);
          return VolumeChange::Set(std::move(m->volume));
        });
      }};
}

absl::StatusOr<KindJob> FuseKind::Stage(StageCall call) {
  // Already mounted by us: nothing to redo (a lost mount is the recovery work's to heal).
  if (call.repeat) return KindJob{"NodeStageVolume (fuse)", nullptr};
  state::Volume& v = call.volume;
  v.mutable_fuse()->set_socket_path(
      absl::StrCat(options_.socket_dir, "/", Sha256Hex(v.volume_id()).substr(0, 32), ".sock"));
  auto [secrets, server_options] = ServerInputs(*call.req);
  const state::ServerPod server_pod = v.fuse().server_pod();
  const std::string vid = v.volume_id();
  const uint32_t uid = v.fuse().server_uid(), gid = v.fuse().server_gid();
  KindJob job = MountJob("NodeStageVolume (fuse)", std::move(v), -1, std::move(call.previous), false,
                         std::move(secrets), std::move(server_options));
  if (server_pod.image().empty()) return job;
  if (options_.server_pods == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "volume ", vid, " declares its server pod (volume_context.serverImage), but this agent has no API server "
        "to create it with (it runs outside a cluster, or without in-cluster credentials)"));
  }
  // The pod first: if the API server cannot make it, nothing is mounted; if the mount then
  // fails, the pod goes again.
  job.before = [this, vid, server_pod, uid, gid](absl::AnyInvocable<void(absl::Status)> then) {
    options_.server_pods->Create(vid, server_pod, uid, gid, std::move(then));
  };
  job.undo = [this, vid] { options_.server_pods->Release(vid); };
  return job;
}

absl::Status FuseKind::CheckPublish(const csi::v1::NodePublishVolumeRequest& req, const state::Volume* staged,
                                    const state::Spec&, bool* read_only) const {
  if (staged != nullptr) {
    if (auto s = CheckStagedMountGroup(*staged, req.volume_capability()); !s.ok()) return s;
    *read_only = StagedTargetBind(req).read_only;
    return absl::OkStatus();
  }
  *read_only = req.readonly();
  return absl::OkStatus();
}

absl::StatusOr<KindJob> FuseKind::Publish(PublishCall call) {
  state::Volume& v = call.volume;
  const csi::v1::NodePublishVolumeRequest& req = *call.req;
  if (!v.staging_path().empty()) {
    // A pod's target of the global mount: a bind that follows it (mount_stack.h). A repeat runs
    // again too: PublishBlocking adopts the bind it finds.
    return StateJob("NodePublishVolume",
                    [ctx = host_.ops_context(), v = std::move(v), index = call.index, previous = std::move(call.previous),
                     bind = StagedTargetBind(req)]() mutable -> absl::StatusOr<std::optional<state::Volume>> {
                      auto r = PublishBlocking(ctx, std::move(v), index, std::move(previous), bind);
                      if (!r.ok()) return r.status();
                      return std::optional<state::Volume>(std::move(*r));
                    });
  }
  // An inline volume: its own FUSE mount on the target, served by the pod's sidecar.
  if (call.repeat) return KindJob{"NodePublishVolume (fuse)", nullptr};
  const std::string pod_uid = ContextValue(req.volume_context(), kPodUidKey);
  if (auto s = CheckName(pod_uid, kPodUidKey); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inline FUSE volumes need the pod's uid in volume_context (CSIDriver podInfoOnMount: true): ", s.message()));
  }
  const std::string socket_volume = ContextValue(req.volume_context(), "socketVolume");
  if (auto s = CheckName(socket_volume, "volume_context.socketVolume"); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inline FUSE volumes need volume_context.socketVolume, the emptyDir shared with the server sidecar: ",
        s.message()));
  }
  std::string socket_name = ContextValue(req.volume_context(), "socketName");
  if (socket_name.empty()) socket_name = kDefaultSocketName;
  v.mutable_fuse()->set_socket_path(absl::StrCat(host_.ops_context().kubelet->path(), "/pods/", pod_uid,
                                                 "/volumes/kubernetes.io~empty-dir/", socket_volume, "/",
                                                 socket_name));
  auto [secrets, server_options] = ServerInputs(req);
  return MountJob("NodePublishVolume (fuse)", std::move(v), call.index, std::move(call.previous), true,
                  std::move(secrets), std::move(server_options));
}

KindJob FuseKind::Unpublish(const state::Volume& v, const state::Target& t) {
  const bool inline_volume = v.staging_path().empty();
  if (inline_volume) StopEndpoint(v.volume_id(), t.path());
  return StateJob("NodeUnpublishVolume",
                  [ctx = host_.ops_context(), v, target = t.path(), inline_volume, id_of_mount = t.mount(),
                   base = TargetBase(t)]() mutable -> absl::StatusOr<std::optional<state::Volume>> {
                    if (inline_volume) {
                      // The pod is going away with its sidecar: abort the connection, then unmount.
                      if (auto s = TearDownFuseMountBlocking(ctx, target, id_of_mount, base, v, true); !s.ok()) {
                        return s;
                      }
                    }
                    return UnpublishBlocking(ctx, std::move(v), target);
                  });
}

KindJob FuseKind::Unstage(const state::Volume& v) {
  StopEndpoint(v.volume_id(), v.staging_path());
  const bool has_server_pod = options_.server_pods != nullptr && !v.fuse().server_pod().image().empty();
  if (has_server_pod) options_.server_pods->Release(v.volume_id());
  KindJob job = StateJob("NodeUnstageVolume",
                         [ctx = host_.ops_context(), v]() -> absl::StatusOr<std::optional<state::Volume>> {
                           if (auto s = TearDownFuseMountBlocking(ctx, v.staging_path(), v.staging_mount(),
                                                                  StagingBase(v), v, false);
                               !s.ok()) {
                             return s;
                           }
                           if (auto s = ctx.store->RemoveBlocking(v.volume_id()); !s.ok()) return s;
                           return std::optional<state::Volume>();
                         });
  if (has_server_pod) {
    // Still staged after all (kubelet retries): its server is wanted again (made at the next resync).
    job.undo = [this, vid = v.volume_id(), spec = v.fuse().server_pod(), uid = v.fuse().server_uid(),
                gid = v.fuse().server_gid()] { options_.server_pods->Want(vid, spec, uid, gid); };
  }
  return job;
}

void FuseKind::Stats(const state::Volume& v, const std::string& path, const std::string& mount_path,
                     const PathMounts& mounts, StatsDone done) {
  // A FUSE mount whose server never connected would make statfs wait: say so instead.
  const std::string served_path = v.staging_path().empty() ? path : v.staging_path();
  auto ep = endpoints_.find(EndpointKey(v.volume_id(), served_path));
  if (ep != endpoints_.end() && !ep->second.gone_reason.empty()) {
    // A server known to be gone: no probe needed (it would only wait).
    csi::v1::NodeGetVolumeStatsResponse resp;
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(ep->second.gone_reason);
    return done(resp);
  }
  if (ep != endpoints_.end() && ep->second.endpoint->awaiting_redeposit()) {
    // Mounted by an earlier agent and possibly still served: ask the mount itself (under the
    // stats deadline), and say what is unknown if it does not answer.
    const std::string socket = v.fuse().socket_path();
    return host_.Probe(path, mount_path, mounts, [socket, done = std::move(done)](StatsResult r) mutable {
      if (r.ok() && r->volume_condition().abnormal()) {
        r->mutable_volume_condition()->set_message(absl::StrCat(
            r->volume_condition().message(), " (the agent restarted, and no FUSE server has "
            "re-deposited this volume's connection on ", socket, " since)"));
      }
      done(std::move(r));
    });
  }
  if (ep != endpoints_.end() && !ep->second.endpoint->served()) {
    csi::v1::NodeGetVolumeStatsResponse resp;
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(
        absl::StrCat("no FUSE server has connected to ", v.fuse().socket_path(), " yet"));
    return done(resp);
  }
  host_.Probe(path, mount_path, mounts, std::move(done));
}

void FuseKind::StartEndpoint(const state::Volume& v, const std::string& path, UniqueFd fuse_fd, UniqueFd listen_fd,
                             const std::map<std::string, std::string>& secrets,
                             const std::vector<std::string>& mount_options, bool unclaimed_timeout) {
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
  const std::string key = EndpointKey(v.volume_id(), path);
  StopEndpoint(v.volume_id(), path);
  HandoffEndpoint::Events events;
  const std::string vid = v.volume_id();
  events.on_served = [this, key, vid, path](const HandoffReply& reply, pid_t pid) {
    auto it = endpoints_.find(key);
    if (it == endpoints_.end()) return;
    it->second.relayed = reply.relayed;
    host_.loop().CancelTimer(it->second.timeout);
    const bool adopted = it->second.endpoint->adoptions() > it->second.adoptions_seen;
    it->second.adoptions_seen = it->second.endpoint->adoptions();
    // A connection no server has initialised yet (not adopted, not handed back after an agent
    // restart): until its server answers FUSE_INIT every access to the mount waits.
    if (!adopted && !reply.redeposit) {
      StartAnswerProbe(it->second, vid, path,
                       absl::StrCat(reply.server.empty() ? "a server that did not name itself" : reply.server,
                                    pid > 0 ? absl::StrCat(", pid ", pid) : ""));
    }
    OnServed(vid, path, adopted);
    // A re-deposit after an agent restart with a new pod's server on standby: the roll it held
    // back can go on now.
    if (options_.server_pods != nullptr && it->second.endpoint->standby() > 0) options_.server_pods->ResyncSoon();
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
  events.on_connection_aborted = [this, vid, key] {
    auto ep = endpoints_.find(key);
    if (ep != endpoints_.end() && ep->second.gave_up) return;  // a server that connects gets a fresh one
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
  HandoffOptions ho;
  ho.reply_timeout = options_.handoff_reply_timeout;
  ho.peer_uid = v.fuse().server_uid();
  ho.redeposit_wait = options_.redeposit_wait;
  if (options_.server_pods != nullptr) {
    ho.drain_wait = absl::Milliseconds(options_.server_pods->settings().drain_ms);
  }
  // A server re-depositing the connection after an agent restart must hand back this mount's.
  ho.expected_connection = MountsAt(v, path).top.dev_minor();
  Endpoint e;
  e.serial = ++endpoint_serial_;
  e.endpoint = HandoffEndpoint::Start(host_.loop(), std::move(listen_fd), std::move(fuse_fd), std::move(config), ho,
                                      std::move(events));
  if (unclaimed_timeout) {
    e.timeout = host_.loop().AddTimer(absl::ToChronoNanoseconds(options_.handoff_timeout),
                                      [this, vid, path] { OnHandoffTimeout(vid, path); });
  }
  LOG(INFO) << "volume " << vid << ": FUSE mount at " << path << " waits for its server on " << v.fuse().socket_path();
  endpoints_[key] = std::move(e);
  // Its server pods' sockets, as more listeners of this endpoint: once the work that started it
  // has recorded the volume and ended its claim.
  if (path == v.staging_path() && options_.server_pods != nullptr) {
    for (const std::string& uid : options_.server_pods->PodUids(vid)) {
      host_.loop().Post([this, vid, uid] { AttachPodListener(vid, uid, options_.pod_dir_retry); });
    }
  }
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
  auto ep = endpoints_.find(EndpointKey(volume_id, v->staging_path()));
  if (ep != endpoints_.end()) ep->second.endpoint->RemoveListener(pod_uid);
}

bool FuseKind::ServerWaitsFrom(const std::string& volume_id, const std::string& pod_uid) const {
  const state::Volume* v = host_.Find(volume_id);
  if (v == nullptr) return false;
  auto ep = endpoints_.find(EndpointKey(volume_id, v->staging_path()));
  if (ep == endpoints_.end()) return false;
  // After an agent restart the live connection is held only by the serving pod's server until
  // it re-deposits it: its pod must not go before that, or the connection goes with it (and
  // every open file and working directory in the pods with the connection).
  if (ep->second.endpoint->awaiting_redeposit()) return false;
  return ep->second.endpoint->HasServerFrom(pod_uid);
}

void FuseKind::AttachPodListener(const std::string& volume_id, const std::string& pod_uid, absl::Duration retry) {
  if (!options_.server_pods->HasPod(volume_id, pod_uid)) return;  // gone meanwhile
  const state::Volume* v = host_.Find(volume_id);
  if (v == nullptr || v->staging_path().empty()) return;  // staged yet? StartEndpoint attaches then
  const std::string path = v->staging_path();
  auto ep = endpoints_.find(EndpointKey(volume_id, path));
  if (ep == endpoints_.end()) return;
  const uint64_t serial = ep->second.serial;
  // The kubelet makes the directory as it starts the pod, usually within seconds: looked for
  // every pod_dir_retry for the first 10 s (a stat each), then less and less often.
  auto again = [this, volume_id, pod_uid, retry] {
    host_.loop().AddTimer(absl::ToChronoNanoseconds(retry), [this, volume_id, pod_uid, retry] {
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
                  auto ep = endpoints_.find(EndpointKey(volume_id, path));
                  if (ep != endpoints_.end() && ep->second.serial == serial &&
                      options_.server_pods->HasPod(volume_id, pod_uid)) {
                    ep->second.endpoint->AddListener(std::move(*fd), pod_uid);
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
  auto it = endpoints_.find(EndpointKey(volume_id, path));
  if (it == endpoints_.end()) return;
  host_.loop().CancelTimer(it->second.timeout);
  StopAnswerProbe(it->second);
  if (it->second.gone_pending > 0) {
    LOG(INFO) << "volume " << volume_id << ": its FUSE server stopped as the volume was unpublished at " << path
              << " (a pod going away): no Warning";
  }
  it->second.endpoint->Stop();
  endpoints_.erase(it);
}

void FuseKind::OnHandoffTimeout(const std::string& volume_id, const std::string& path) {
  auto ep = endpoints_.find(EndpointKey(volume_id, path));
  // A server serves it now: nothing to give up on (also when this timer was armed as an earlier
  // server stopped, and another has taken the volume since).
  if (ep == endpoints_.end() || ep->second.endpoint->serving() || ep->second.gave_up) return;
  const state::Volume* v = host_.Find(volume_id);
  if (v == nullptr) return;
  ClaimQueue::Claim claim = host_.TryClaim(volume_id);
  if (!claim) {
    // An RPC on this volume is in progress; look again shortly.
    ep->second.timeout = host_.loop().AddTimer(std::chrono::seconds(1), [this, volume_id, path] {
      OnHandoffTimeout(volume_id, path);
    });
    return;
  }
  // The mount stays a mount: unmounting it would leave the pod writing to a plain directory on
  // the node's disk. Its connection is aborted instead, so that everything waiting on it (a
  // container being created stats its mounts) fails fast with ENOTCONN, and the endpoint keeps
  // listening: a server that connects later gets a fresh connection stacked on this mount.
  const bool was_served = ep->second.endpoint->served();
  const std::string message =
      was_served
          // A server took the volume and stopped (a program that dies before it answers FUSE_INIT
          // would leave the pod's reads waiting forever): the same bound as for a server that
          // never comes.
          ? absl::StrCat("the FUSE server stopped (", ep->second.gone_reason, ") and no server served volume ",
                         volume_id, " again within ", absl::FormatDuration(options_.handoff_timeout),
                         "; the mount now fails fast (ENOTCONN) until one does")
          : absl::StrCat("no FUSE server connected to ", v->fuse().socket_path(), " within ",
                         absl::FormatDuration(options_.handoff_timeout),
                         "; the mount now fails fast (ENOTCONN) until one does. Check that the server (sidecar or "
                         "node-level) runs as uid ",
                         v->fuse().server_uid(), ", that it is given that socket path",
                         v->staging_path().empty() ? " (the pod's emptyDir named in volume_context socketVolume)" : "",
                         ", and its logs");
  GiveUpOnConnection(ep->second, *v, path, std::move(claim),
                     was_served ? "FuseServerNotServing" : "FuseServerNeverConnected", message,
                     "handoff timeout: abort the unserved connection");
}

void FuseKind::GiveUpOnConnection(Endpoint& e, const state::Volume& v, const std::string& path,
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

void FuseKind::StartAnswerProbe(Endpoint& e, const std::string& volume_id, const std::string& path,
                                std::string server) {
  StopAnswerProbe(e);
  if (options_.init_timeout <= absl::ZeroDuration()) return;
  e.answer_server = std::move(server);
  const uint64_t serial = e.serial;
  const std::string key = EndpointKey(volume_id, path);
  const absl::Time asked = absl::Now();
  e.answer_probe = AnswerProbe::Start(host_.loop(), path, [this, key, serial, asked, volume_id](int32_t res) {
    auto ep = endpoints_.find(key);
    if (ep == endpoints_.end() || ep->second.serial != serial) return;
    host_.loop().CancelTimer(ep->second.init_timer);
    ep->second.init_timer = 0;
    ep->second.answer_probe.reset();
    // Any answer counts, an error too (a server that refused FUSE_INIT does answer). ENOTCONN:
    // the connection was aborted meanwhile (a repair, or the kernel), which its own event reports.
    const std::string after = absl::FormatDuration(absl::Trunc(absl::Now() - asked, absl::Milliseconds(1)));
    if (res == -ENOTCONN) {
      LOG(INFO) << "volume " << volume_id << ": its FUSE connection was aborted " << after << " after the handoff, "
                << "before its server (" << ep->second.answer_server << ") had answered";
    } else {
      LOG(INFO) << "volume " << volume_id << ": its FUSE server (" << ep->second.answer_server
                << ") answered the kernel's first requests" << (res < 0 ? absl::StrCat(" (", strerror(-res), ")") : "")
                << " " << after << " after the handoff";
    }
  });
  e.init_timer = host_.loop().AddTimer(absl::ToChronoNanoseconds(options_.init_timeout),
                                       [this, volume_id, path] { OnInitTimeout(volume_id, path); });
}

void FuseKind::StopAnswerProbe(Endpoint& e) {
  host_.loop().CancelTimer(e.init_timer);
  e.init_timer = 0;
  if (e.answer_probe != nullptr) {
    if (e.answer_probe->pending()) {
      LOG(INFO) << "no longer waiting for " << e.answer_probe->path() << "'s FUSE server (" << e.answer_server
                << ") to answer: its connection is going";
    }
    e.answer_probe->Abandon();
  }
  e.answer_probe.reset();
}

void FuseKind::OnInitTimeout(const std::string& volume_id, const std::string& path) {
  auto ep = endpoints_.find(EndpointKey(volume_id, path));
  if (ep == endpoints_.end()) return;
  ep->second.init_timer = 0;
  // Answered meanwhile (the probe's end cancels this timer, unless it came during a retry).
  if (ep->second.answer_probe == nullptr || !ep->second.answer_probe->pending()) return;
  const state::Volume* v = host_.Find(volume_id);
  if (v == nullptr) return;
  ClaimQueue::Claim claim = host_.TryClaim(volume_id);
  if (!claim) {
    // An RPC on this volume is in progress (an unstage aborts the connection itself); look
    // again shortly.
    ep->second.init_timer = host_.loop().AddTimer(std::chrono::seconds(1), [this, volume_id, path] {
      OnInitTimeout(volume_id, path);
    });
    return;
  }
  const std::string server = ep->second.answer_server;
  StopAnswerProbe(ep->second);  // the abort ends it (ENOTCONN): nothing more to learn from it
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
  GiveUpOnConnection(ep->second, *v, path, std::move(claim), "FuseServerNotAnswering", message,
                     "init timeout: abort the connection its server does not answer");
}

}  // namespace fusekeeper
