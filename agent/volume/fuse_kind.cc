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

using csi::v1::VolumeCapability;

constexpr char kDefaultSocketName[] = "fusekeeper.sock";

// volume_context keys this kind reads itself; every other key is handed to the FUSE server.
bool IsAgentKey(const std::string& k) {
  return k == "kind" || k == "serverUid" || k == "serverGid" || k == "subtype" || k == "socketVolume" ||
         k == "socketName" || k == "passSecrets" || IsServerPodKey(k) || IsFuseTuningKey(k);
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

FuseKind::FuseKind(VolumeHost& host, FuseKindOptions options)
    : VolumeKind(host),
      options_(std::move(options)),
      endpoints_(host.loop()),
      broker_(host.loop()),
      repairs_(host.loop(), options_.repair_backoff, options_.max_repair_backoff),
      later_(host.loop()) {
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
  if (auto s = ParseFuseTuning(ctx, &fuse); !s.ok()) return s;
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
          StartEndpoint(m->volume, path, std::move(m->fuse_fd), std::move(m->socket), secrets, server_options);
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
                      auto source = OpenStagingMountBlocking(ctx, v);
                      if (!source.ok()) return source.status();
                      auto r = PublishBlocking(ctx, std::move(v), index, std::move(previous), bind, std::move(*source));
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
  const FuseEndpoint* ep = endpoints_.Find(v.volume_id(), served_path);
  if (ep != nullptr && !ep->gone_reason.empty()) {
    // A server known to be gone: no probe needed (it would only wait).
    csi::v1::NodeGetVolumeStatsResponse resp;
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(ep->gone_reason);
    return done(resp);
  }
  // (No endpoint yet: a restarted agent is still making its socket again.)
  const bool awaiting_redeposit =
      ep != nullptr ? ep->endpoint->awaiting_redeposit() : restoring_.count(v.volume_id()) > 0;
  if (awaiting_redeposit) {
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
  if (ep != nullptr && !ep->endpoint->served()) {
    csi::v1::NodeGetVolumeStatsResponse resp;
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(
        absl::StrCat("no FUSE server has connected to ", v.fuse().socket_path(), " yet"));
    return done(resp);
  }
  host_.Probe(path, mount_path, mounts, std::move(done));
}

}  // namespace fusekeeper
