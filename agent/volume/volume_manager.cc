#include "agent/volume/volume_manager.h"

#include "agent/volume/mount_stack.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "agent/paths/host_path.h"
#include "agent/volume/mount_stack.h"
#include "agent/volume/reconcile.h"
#include "glog/logging.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace fusekeeper {
namespace {

using csi::v1::VolumeCapability;

constexpr char kKindHostPath[] = "hostPath";
constexpr char kKindFuse[] = "fuse";
constexpr char kPodUidKey[] = "csi.storage.k8s.io/pod.uid";
constexpr char kPodNameKey[] = "csi.storage.k8s.io/pod.name";
constexpr char kPodNamespaceKey[] = "csi.storage.k8s.io/pod.namespace";

// What volume_context (and the capability) ask for, validated.
struct VolumeSpec {
  std::string kind;
  // hostPath
  std::string path;
  std::string type;
  // fuse
  state::Fuse fuse;
  std::string socket_volume;  // inline: the pod's emptyDir holding the handoff socket
  std::string socket_name = "fusekeeper.sock";
  std::map<std::string, std::string> server_context;  // handed to the FUSE server
};

std::string Get(const google::protobuf::Map<std::string, std::string>& ctx, const char* key) {
  auto it = ctx.find(key);
  return it == ctx.end() ? "" : it->second;
}

absl::StatusOr<uint32_t> ParseId(const std::string& value, absl::string_view what) {
  if (value.empty() || value.size() > 10 || value.find_first_not_of("0123456789") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", value, "' is not a numeric id"));
  }
  uint64_t v = std::stoull(value);
  if (v > UINT32_MAX) return absl::InvalidArgumentError(absl::StrCat(what, " '", value, "' is out of range"));
  return static_cast<uint32_t>(v);
}

// A single path component chosen by a pod author.
absl::Status CheckName(const std::string& name, absl::string_view what) {
  if (name.empty() || name.size() > 253 || name == "." || name == ".." ||
      name.find_first_of("/\0", 0, 2) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", name, "' is not a valid name"));
  }
  return absl::OkStatus();
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

absl::StatusOr<VolumeSpec> ParseSpec(const google::protobuf::Map<std::string, std::string>& ctx,
                                     const VolumeCapability& cap) {
  VolumeSpec spec;
  spec.kind = Get(ctx, "kind");
  if (spec.kind.empty()) {
    return absl::InvalidArgumentError("volume_context.kind is required (supported: hostPath, fuse)");
  }
  const std::string group = cap.mount().volume_mount_group();
  if (spec.kind == kKindHostPath) {
    spec.path = Get(ctx, "path");
    spec.type = Get(ctx, "type");
    if (spec.path.empty()) return absl::InvalidArgumentError("volume_context.path is required for hostPath");
    if (auto s = ValidateHostPath(spec.path); !s.ok()) return s;
    if (auto t = ParseHostPathType(spec.type); !t.ok()) return t.status();
    if (!group.empty()) {
      // A bind mount cannot re-present ownership; kubelet does not chown either (fsGroup is
      // delegated to us), so say so rather than pretend.
      if (auto g = ParseId(group, "volume_mount_group"); !g.ok()) return g.status();
      LOG(WARNING) << "hostPath volumes do not apply volume_mount_group (fsGroup " << group
                   << "): files keep their owners";
    }
    return spec;
  }
  if (spec.kind != kKindFuse) {
    return absl::InvalidArgumentError(
        absl::StrCat("volume_context.kind '", spec.kind, "' is not supported (supported: hostPath, fuse)"));
  }
  spec.fuse.set_subtype(Get(ctx, "subtype").empty() ? "fusekeeper" : Get(ctx, "subtype"));
  if (spec.fuse.subtype().find_first_of(",= \t\n/") != std::string::npos || spec.fuse.subtype().size() > 64) {
    return absl::InvalidArgumentError(absl::StrCat("volume_context.subtype '", spec.fuse.subtype(), "' is not valid"));
  }
  const std::string uid = Get(ctx, "serverUid"), gid = Get(ctx, "serverGid");
  if (!uid.empty()) {
    auto u = ParseId(uid, "volume_context.serverUid");
    if (!u.ok()) return u.status();
    spec.fuse.set_server_uid(*u);
  }
  if (!gid.empty() || !uid.empty()) {
    auto g = ParseId(gid.empty() ? uid : gid, "volume_context.serverGid");
    if (!g.ok()) return g.status();
    spec.fuse.set_server_gid(*g);
  }
  if (!group.empty()) {
    auto g = ParseId(group, "volume_mount_group");
    if (!g.ok()) return g.status();
    spec.fuse.set_has_mount_group(true);
    spec.fuse.set_mount_group(*g);
  }
  spec.fuse.set_pass_secrets(Get(ctx, "passSecrets") == "true");
  if (auto s = ParseFuseMountFlags(cap, &spec.fuse, nullptr); !s.ok()) return s;
  spec.socket_volume = Get(ctx, "socketVolume");
  if (!Get(ctx, "socketName").empty()) spec.socket_name = Get(ctx, "socketName");
  if (auto s = CheckName(spec.socket_name, "volume_context.socketName"); !s.ok()) return s;
  for (const auto& [k, v] : ctx) {
    if (k == "kind" || k == "serverUid" || k == "serverGid" || k == "subtype" ||
        k == "socketVolume" || k == "socketName" || k == "passSecrets") {
      continue;
    }
    spec.server_context[k] = v;
  }
  return spec;
}

// Whether `a` and `b` are the same path or one lies inside the other.
bool Overlaps(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  return IsAtOrBelow(a, b) || IsAtOrBelow(b, a);
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

// Mount flags a host-path bind honours. Rejected flags are named by position only: they may
// carry secrets.
absl::StatusOr<BindOptions> ParseBindOptions(const VolumeCapability& cap, bool readonly) {
  BindOptions o;
  o.read_only = readonly ||
                cap.access_mode().mode() == VolumeCapability::AccessMode::SINGLE_NODE_READER_ONLY ||
                cap.access_mode().mode() == VolumeCapability::AccessMode::MULTI_NODE_READER_ONLY;
  const auto& flags = cap.mount().mount_flags();
  for (int i = 0; i < flags.size(); ++i) {
    const std::string& f = flags[i];
    if (f == "ro") {
      o.read_only = true;
    } else if (f == "rw" || f == "bind" || f == "defaults") {
    } else if (f == "nosuid") {
      o.nosuid = true;
    } else if (f == "nodev") {
      o.nodev = true;
    } else if (f == "noexec") {
      o.noexec = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "mount flag #", i + 1,
          " is not supported for hostPath volumes (supported: ro, rw, nosuid, nodev, noexec)"));
    }
  }
  return o;
}

std::string Fingerprint(const VolumeSpec& spec, const VolumeCapability& cap, bool readonly,
                        const std::string& staging) {
  state::Spec s;
  s.set_kind(spec.kind);
  s.set_host_path(spec.path);
  s.set_host_path_type(spec.type);
  *s.mutable_fuse() = spec.fuse;
  for (const auto& [k, v] : spec.server_context) (*s.mutable_volume_context())[k] = v;
  s.set_access_mode(cap.access_mode().mode());
  for (const auto& f : cap.mount().mount_flags()) s.add_mount_flags(f);
  s.set_volume_mount_group(cap.mount().volume_mount_group());
  s.set_readonly(readonly);
  s.set_staging_path(staging);
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  {
    google::protobuf::io::CodedOutputStream out(&stream);
    out.SetSerializationDeterministic(true);
    s.SerializeToCodedStream(&out);
  }
  return Sha256Hex(bytes);
}

// The volume state a spec describes (identity fields left to the blocking half).
void ApplySpec(const VolumeSpec& spec, state::Volume* v) {
  v->set_kind(spec.kind);
  v->set_host_path(spec.path);
  v->set_host_path_type(spec.type);
  if (spec.kind == kKindFuse) {
    std::string socket_path = v->fuse().socket_path();
    *v->mutable_fuse() = spec.fuse;
    v->mutable_fuse()->set_socket_path(socket_path);
    v->clear_volume_context();
    for (const auto& [k, val] : spec.server_context) (*v->mutable_volume_context())[k] = val;
  }
}

bool IsFuse(const state::Volume& v) { return v.kind() == kKindFuse; }

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

}  // namespace

VolumeManager::VolumeManager(Loop& loop, BlockingPool& pool, const KubeletDir& kubelet,
                             const StateStore& store, MountTableReader& table_reader,
                             VolumeManagerOptions options, BlockingPool* probe_pool)
    : loop_(loop),
      pool_(pool),
      kubelet_(kubelet),
      store_(store),
      table_reader_(table_reader),
      options_(options),
      ctx_{&kubelet, &store, options.ephemeral_host_path_prefixes, options.host_root},
      own_probe_pool_(probe_pool != nullptr
                          ? nullptr
                          : std::make_unique<BlockingPool>(
                                loop, BlockingPoolOptions{.threads = options.probe_threads,
                                                          .max_threads = options.max_probe_threads,
                                                          .max_queued = 1024})),
      probe_pool_(probe_pool != nullptr ? probe_pool : own_probe_pool_.get()) {}

void VolumeManager::Start(Done done) {
  struct Loaded {
    std::vector<state::Volume> volumes;
    std::vector<std::string> problems;
  };
  auto loaded = std::make_shared<Loaded>();
  absl::Status submitted = pool_.Submit(
      "load state",
      [this, loaded] {
        auto v = store_.LoadAllBlocking(&loaded->problems);
        if (v.ok()) loaded->volumes = std::move(*v);
        else loaded->problems.push_back(std::string(v.status().message()));
      },
      [this, loaded, done = std::move(done)](absl::Status s) mutable {
        if (!s.ok()) return done(s);
        for (const auto& p : loaded->problems) LOG(WARNING) << p;
        table_reader_.Read([this, loaded, done = std::move(done)](
                               absl::StatusOr<std::shared_ptr<const MountTable>> table) mutable {
          if (!table.ok()) return done(table.status());
          ReconcileOutcome outcome =
              Reconcile(std::move(loaded->volumes), **table,
                        [this](const std::string& p) { return kubelet_.MountTablePath(p); });
          for (const auto& note : outcome.notes) LOG(INFO) << "reconcile: " << note;
          for (auto& v : outcome.volumes) volumes_[v.volume_id()] = v;
          auto save = std::make_shared<ReconcileOutcome>(std::move(outcome));
          absl::Status sub = pool_.Submit(
              "save reconciled state",
              [this, save] {
                for (const auto& v : save->save) {
                  if (auto s = store_.SaveBlocking(v); !s.ok()) LOG(ERROR) << s;
                }
                for (const auto& id : save->remove) {
                  if (auto s = store_.RemoveBlocking(id); !s.ok()) LOG(ERROR) << s;
                }
              },
              [this, done = std::move(done)](absl::Status s) mutable {
                ready_ = s.ok();
                LOG(INFO) << "volume state reconciled: " << volumes_.size() << " volumes";
                if (ready_) ListenAgain();
                done(s);
              });
          if (!sub.ok()) LOG(ERROR) << sub;
        });
      });
  if (!submitted.ok()) LOG(ERROR) << submitted;
}

absl::Status VolumeManager::Claim(const std::string& volume_id) {
  if (!ready_) return absl::UnavailableError("fusekeeper is still reconciling volume state; retry");
  if (!busy_.insert(volume_id).second) {
    return absl::AbortedError(
        absl::StrCat("an operation on volume ", volume_id, " is already in progress"));
  }
  return absl::OkStatus();
}

void VolumeManager::Release(const std::string& volume_id) {
  busy_.erase(volume_id);
  auto it = waiters_.find(volume_id);
  if (it == waiters_.end()) return;
  std::shared_ptr<Waiter> next = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) waiters_.erase(it);
  loop_.CancelTimer(next->timer);
  // Run after the current callback: the finished operation's `done` answers first. The waiter
  // starts from scratch (it sees the state the finished operation left).
  loop_.Post([next] { next->run(std::move(next->done)); });
}

void VolumeManager::RunVolumeJob(
    const std::string& volume_id, std::string reason,
    absl::AnyInvocable<absl::StatusOr<std::optional<state::Volume>>()> work, Done done) {
  RunJob<std::optional<state::Volume>>(
      volume_id, std::move(reason), std::move(work),
      [this, volume_id](std::optional<state::Volume> v) {
        if (v.has_value()) {
          volumes_[volume_id] = std::move(*v);
        } else {
          volumes_.erase(volume_id);
        }
        return absl::OkStatus();
      },
      std::move(done));
}

absl::Status VolumeManager::CheckPathFree(const std::string& path, const std::string& volume_id,
                                          const std::string& field) const {
  for (const auto& [id, v] : volumes_) {
    std::vector<std::pair<std::string, std::string>> paths;  // (path, what it is)
    if (!v.staging_path().empty()) paths.emplace_back(v.staging_path(), "staging path");
    for (const auto& t : v.targets()) paths.emplace_back(t.path(), "target");
    for (const auto& [p, what] : paths) {
      // The same path of the same volume is a repeat; anything else overlapping is refused.
      if (id == volume_id && p == path) continue;
      if (!Overlaps(path, p)) continue;
      return absl::AlreadyExistsError(absl::StrCat(
          field, " ", path, p == path ? " is " : " overlaps ", id == volume_id ? "this volume's own " : "",
          what, p == path ? "" : absl::StrCat(" ", p), id == volume_id ? "" : absl::StrCat(" of volume ", id),
          ": a path may belong to one volume only"));
    }
  }
  return absl::OkStatus();
}

const state::Target* VolumeManager::FindTargetOwner(const std::string& path, std::string* owner) const {
  for (const auto& [id, v] : volumes_) {
    for (const auto& t : v.targets()) {
      if (t.path() == path) {
        *owner = id;
        return &t;
      }
    }
  }
  return nullptr;
}

std::string VolumeManager::EndpointKey(const std::string& volume_id, const std::string& path) {
  return absl::StrCat(volume_id, "\n", path);
}

void VolumeManager::StartEndpoint(const state::Volume& v, const std::string& path, UniqueFd fuse_fd,
                                  UniqueFd listen_fd, const std::map<std::string, std::string>& secrets,
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
  events.on_served = [this, key, vid, path](const HandoffReply&, pid_t) {
    auto it = endpoints_.find(key);
    if (it == endpoints_.end()) return;
    loop_.CancelTimer(it->second.timeout);
    const bool adopted = it->second.endpoint->adoptions() > it->second.adoptions_seen;
    it->second.adoptions_seen = it->second.endpoint->adoptions();
    OnServed(vid, path, adopted);
  };
  events.on_server_gone = [this, vid, path](const absl::Status& why) { OnServerGone(vid, path, why); };
  events.on_fresh_requested = [this, vid] {
    RepairFuse(vid, "its restarted FUSE server cannot adopt the live connection and asked for a fresh one");
  };
  events.on_connection_aborted = [this, vid, key] {
    auto ep = endpoints_.find(key);
    if (ep != endpoints_.end() && ep->second.gave_up) return;  // a server that connects gets a fresh one
    RepairFuse(vid, "its FUSE connection was aborted");
  };
  HandoffOptions ho;
  ho.reply_timeout = options_.handoff_reply_timeout;
  ho.peer_uid = v.fuse().server_uid();
  ho.redeposit_wait = options_.redeposit_wait;
  // A server re-depositing the connection after an agent restart must hand back this mount's.
  ho.expected_connection = MountsAt(v, path).top.dev_minor();
  Endpoint e;
  e.serial = ++endpoint_serial_;
  e.endpoint = HandoffEndpoint::Start(loop_, std::move(listen_fd), std::move(fuse_fd), std::move(config), ho,
                                      std::move(events));
  const std::string id = v.volume_id();
  if (unclaimed_timeout) {
    e.timeout = loop_.AddTimer(absl::ToChronoNanoseconds(options_.handoff_timeout),
                               [this, id, path] { OnHandoffTimeout(id, path); });
  }
  LOG(INFO) << "volume " << id << ": FUSE mount at " << path << " waits for its server on "
            << v.fuse().socket_path();
  endpoints_[key] = std::move(e);
}

void VolumeManager::ListenAgain() {
  // The FUSE connections of volumes mounted before a restart died with the old agent's fds
  // only if their servers are gone too. Each volume gets its handoff socket back, without a
  // connection to offer: a server still serving it re-deposits its fd there (handoff_protocol.h),
  // and a server that connects without one is given a fresh connection.
  for (const auto& [id, v] : volumes_) {
    if (v.kind() != "fuse" || v.fuse().socket_path().empty()) continue;
    const std::string path = !v.staging_path().empty() ? v.staging_path()
                             : v.targets_size() == 1   ? v.targets(0).path()
                                                       : "";
    if (path.empty() || endpoints_.count(EndpointKey(id, path)) > 0) continue;
    // Under the volume's claim: a repair (which makes the socket again itself) or an RPC on the
    // volume must not interleave with replacing its socket file. A volume that is busy now gets
    // its socket from that work's repair instead.
    if (!busy_.insert(id).second) continue;
    auto listen = std::make_shared<absl::StatusOr<UniqueFd>>(absl::UnknownError("not run"));
    absl::Status s = pool_.Submit(
        "handoff socket after restart",
        [ctx = ctx_, v = v, listen] { *listen = ListenForServerBlocking(ctx, v); },
        [this, id = id, path, listen](absl::Status ran) {
          Release(id);
          auto it = volumes_.find(id);
          if (!ran.ok() || it == volumes_.end()) return;
          if (!listen->ok()) {
            LOG(WARNING) << "volume " << id << ": cannot listen for its FUSE server again: " << listen->status();
            return;
          }
          StartEndpoint(it->second, path, UniqueFd(), std::move(**listen), {}, {}, /*unclaimed_timeout=*/false);
        });
    if (!s.ok()) {
      Release(id);
      LOG(WARNING) << s;
    }
  }
}

void VolumeManager::StopEndpoint(const std::string& volume_id, const std::string& path) {
  auto it = endpoints_.find(EndpointKey(volume_id, path));
  if (it == endpoints_.end()) return;
  loop_.CancelTimer(it->second.timeout);
  if (it->second.gone_pending > 0) {
    LOG(INFO) << "volume " << volume_id << ": its FUSE server stopped as the volume was unpublished at " << path
              << " (a pod going away): no Warning";
  }
  it->second.endpoint->Stop();
  endpoints_.erase(it);
}

void VolumeManager::OnHandoffTimeout(const std::string& volume_id, const std::string& path) {
  auto ep = endpoints_.find(EndpointKey(volume_id, path));
  if (ep == endpoints_.end() || ep->second.endpoint->served()) return;
  if (!busy_.insert(volume_id).second) {
    // An RPC on this volume is in progress; look again shortly.
    ep->second.timeout = loop_.AddTimer(std::chrono::seconds(1), [this, volume_id, path] {
      OnHandoffTimeout(volume_id, path);
    });
    return;
  }
  auto it = volumes_.find(volume_id);
  if (it == volumes_.end()) {
    Release(volume_id);
    return;
  }
  // The mount stays a mount: unmounting it would leave the pod writing to a plain directory on
  // the node's disk. Its connection is aborted instead, so that everything waiting on it (a
  // container being created stats its mounts) fails fast with ENOTCONN, and the endpoint keeps
  // listening: a server that connects later gets a fresh connection stacked on this mount.
  ep->second.gave_up = true;
  const state::Volume& v = it->second;
  const std::string message = absl::StrCat(
      "no FUSE server connected to ", v.fuse().socket_path(), " within ", absl::FormatDuration(options_.handoff_timeout),
      "; the mount now fails fast (ENOTCONN) until one does. Check that the server (sidecar or node-level) runs as uid ",
      v.fuse().server_uid(), ", that it is given that socket path",
      v.staging_path().empty() ? " (the pod's emptyDir named in volume_context socketVolume)" : "",
      ", and its logs");
  ep->second.gone_reason = message;
  LOG(WARNING) << "volume " << volume_id << ": " << message;
  EventForVolume(v, "Warning", "FuseServerNeverConnected", message);
  const PathMounts mounts = MountsAt(v, path);
  absl::Status s = pool_.Submit(
      "handoff timeout: abort the unserved connection",
      [ctx = ctx_, path, mounts] {
        AbortConnectionsAtBlocking(*ctx.kubelet, path, {mounts.top.dev_minor(), mounts.base.dev_minor()});
      },
      [this, volume_id](absl::Status) { Release(volume_id); });
  if (!s.ok()) Release(volume_id);
}

void VolumeManager::Stage(const csi::v1::NodeStageVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  if (WaitTurn(id, req, done, &VolumeManager::Stage)) return;
  auto spec = ParseSpec(req.volume_context(), req.volume_capability());
  if (!spec.ok()) return done(spec.status());
  if (auto rel = kubelet_.Relative(req.staging_target_path(), "staging_target_path"); !rel.ok()) {
    return done(rel.status());
  }
  std::optional<BindOptions> bind;
  if (spec->kind == kKindHostPath) {
    auto b = ParseBindOptions(req.volume_capability(), false);
    if (!b.ok()) return done(b.status());
    bind = *b;
  }
  if (auto s = CheckPathFree(req.staging_target_path(), id, "staging_target_path"); !s.ok()) return done(s);
  const std::string fp = Fingerprint(*spec, req.volume_capability(), false, "");
  std::optional<state::Volume> previous;
  state::Volume v;
  bool repeat = false;
  auto it = volumes_.find(id);
  if (it != volumes_.end()) {
    previous = it->second;
    v = it->second;
    if (!v.staging_path().empty()) {
      if (v.staging_path() != req.staging_target_path()) {
        return done(absl::AlreadyExistsError(absl::StrCat("volume ", id, " is already staged at ",
                                                          v.staging_path())));
      }
      if (v.staging_fingerprint() != fp) {
        return done(absl::AlreadyExistsError(absl::StrCat(
            "volume ", id, " is already staged at this path with different parameters")));
      }
      repeat = true;
    } else if (v.targets_size() > 0) {
      return done(absl::AlreadyExistsError(
          absl::StrCat("volume ", id, " is published as an ephemeral (unstaged) volume")));
    }
  } else {
    v.set_volume_id(id);
  }
  ApplySpec(*spec, &v);
  v.set_staging_path(req.staging_target_path());
  v.set_staging_fingerprint(fp);
  if (auto s = Claim(id); !s.ok()) return done(s);
  if (spec->kind == kKindFuse) {
    if (repeat) {
      // Already mounted by us: nothing to redo (a lost mount is the recovery work's to heal).
      Release(id);
      return done(absl::OkStatus());
    }
    v.mutable_fuse()->set_socket_path(
        absl::StrCat(options_.socket_dir, "/", Sha256Hex(id).substr(0, 32), ".sock"));
    return StageFuse(req, std::move(v), std::move(previous), std::move(done));
  }
  RunVolumeJob(
      id, "NodeStageVolume",
      [ctx = ctx_, v = std::move(v), previous = std::move(previous), bind = *bind]() mutable
      -> absl::StatusOr<std::optional<state::Volume>> {
        auto r = StageBlocking(ctx, std::move(v), std::move(previous), bind);
        if (!r.ok()) return r.status();
        return std::optional<state::Volume>(std::move(*r));
      },
      std::move(done));
}

void VolumeManager::StageFuse(const csi::v1::NodeStageVolumeRequest& req, state::Volume v,
                              std::optional<state::Volume> previous, Done done) {
  auto [secrets, options] = ServerInputs(req);
  const std::string id = v.volume_id();
  RunJob<std::shared_ptr<FuseMounted>>(
      id, "NodeStageVolume (fuse)",
      [ctx = ctx_, v = std::move(v), previous = std::move(previous)]() mutable
      -> absl::StatusOr<std::shared_ptr<FuseMounted>> {
        auto m = MountFuseVolumeBlocking(ctx, std::move(v), -1, std::move(previous), false);
        if (!m.ok()) return m.status();
        return std::make_shared<FuseMounted>(std::move(*m));
      },
      [this, secrets, options](std::shared_ptr<FuseMounted> m) {
        volumes_[m->volume.volume_id()] = m->volume;
        StartEndpoint(m->volume, m->volume.staging_path(), std::move(m->fuse_fd), std::move(m->listen_fd),
                      secrets, options);
        return absl::OkStatus();
      },
      std::move(done));
}

void VolumeManager::Unstage(const csi::v1::NodeUnstageVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  if (WaitTurn(id, req, done, &VolumeManager::Unstage)) return;
  if (auto rel = kubelet_.Relative(req.staging_target_path(), "staging_target_path"); !rel.ok()) {
    return done(rel.status());
  }
  auto it = volumes_.find(id);
  if (it == volumes_.end() || it->second.staging_path().empty()) {
    // Already unstaged (a repeat), or never staged by us: OK if nothing is mounted there.
    if (auto s = Claim(id); !s.ok()) return done(s);
    std::string path = req.staging_target_path();
    return RunVolumeJob(
        id, "NodeUnstageVolume",
        [ctx = ctx_, path, id, known = it != volumes_.end(),
         v = it != volumes_.end() ? it->second : state::Volume()]()
            -> absl::StatusOr<std::optional<state::Volume>> {
          if (auto s = ForgetUnknownPathBlocking(ctx, path, id, /*remove_dir=*/false); !s.ok()) return s;
          if (known) return std::optional<state::Volume>(v);
          return std::optional<state::Volume>();
        },
        std::move(done));
  }
  const state::Volume& v = it->second;
  if (v.staging_path() != req.staging_target_path()) {
    return done(absl::NotFoundError(absl::StrCat("volume ", id, " is staged at ", v.staging_path(),
                                                 ", not at ", req.staging_target_path())));
  }
  if (v.targets_size() > 0) {
    return done(absl::FailedPreconditionError(absl::StrCat(
        "volume ", id, " is still published at ", v.targets_size(),
        " target(s), e.g. ", v.targets(0).path(), "; unpublish them first")));
  }
  if (auto s = Claim(id); !s.ok()) return done(s);
  if (IsFuse(v)) StopEndpoint(id, v.staging_path());
  RunVolumeJob(
      id, "NodeUnstageVolume",
      [ctx = ctx_, v]() -> absl::StatusOr<std::optional<state::Volume>> {
        if (IsFuse(v)) {
          if (auto s = TearDownFuseMountBlocking(ctx, v.staging_path(), v.staging_mount(), StagingBase(v), v, false); !s.ok()) {
            return s;
          }
          if (auto s = ctx.store->RemoveBlocking(v.volume_id()); !s.ok()) return s;
          return std::optional<state::Volume>();
        }
        if (auto s = UnstageBlocking(ctx, v); !s.ok()) return s;
        return std::optional<state::Volume>();
      },
      std::move(done));
}

void VolumeManager::Publish(const csi::v1::NodePublishVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  if (WaitTurn(id, req, done, &VolumeManager::Publish)) return;
  const std::string& target = req.target_path();
  if (auto rel = kubelet_.Relative(target, "target_path"); !rel.ok()) return done(rel.status());
  const bool staged = !req.staging_target_path().empty();
  if (staged) {
    if (auto rel = kubelet_.Relative(req.staging_target_path(), "staging_target_path"); !rel.ok()) {
      return done(rel.status());
    }
  }

  std::optional<state::Volume> previous;
  state::Volume v;
  VolumeSpec spec;
  auto it = volumes_.find(id);
  if (staged) {
    if (it == volumes_.end() || it->second.staging_path().empty()) {
      return done(absl::NotFoundError(absl::StrCat("volume ", id, " is not staged on this node")));
    }
    if (it->second.staging_path() != req.staging_target_path()) {
      return done(absl::FailedPreconditionError(absl::StrCat(
          "volume ", id, " is staged at ", it->second.staging_path(), ", not at ",
          req.staging_target_path())));
    }
    spec.kind = it->second.kind().empty() ? kKindHostPath : it->second.kind();
    spec.path = it->second.host_path();
    spec.type = it->second.host_path_type();
    spec.fuse = it->second.fuse();
    spec.fuse.clear_socket_path();
    if (spec.kind == kKindFuse) {
      if (auto s = CheckStagedMountGroup(it->second, req.volume_capability()); !s.ok()) return done(s);
    }
  } else {
    auto parsed = ParseSpec(req.volume_context(), req.volume_capability());
    if (!parsed.ok()) return done(parsed.status());
    spec = *parsed;
    if (spec.kind == kKindHostPath && !EphemeralHostPathAllowed(ctx_, spec.path)) {
      // Unstaged host-path volumes are chosen by pod authors (CSI inline volumes), not by the
      // administrator who creates PersistentVolumes: only allowed below configured prefixes.
      return done(absl::PermissionDeniedError(absl::StrCat(
          "unstaged (ephemeral inline) hostPath volumes may only use paths below "
          "--ephemeral_host_path_prefixes", ctx_.ephemeral_host_path_prefixes.empty() ? " (none set)" : "",
          "; ", spec.path, " is not")));
    }
    if (it != volumes_.end() && !it->second.staging_path().empty()) {
      return done(absl::FailedPreconditionError(absl::StrCat(
          "volume ", id, " is staged at ", it->second.staging_path(),
          "; NodePublishVolume must pass that staging_target_path")));
    }
    if (it != volumes_.end() && (it->second.kind() != spec.kind || it->second.host_path() != spec.path ||
                                 it->second.host_path_type() != spec.type)) {
      return done(absl::AlreadyExistsError(
          absl::StrCat("volume ", id, " is already published with a different volume_context")));
    }
  }
  const bool fuse_inline = !staged && spec.kind == kKindFuse;
  std::optional<BindOptions> bind;
  if (!fuse_inline) {
    auto b = ParseBindOptions(req.volume_capability(), req.readonly());
    if (!b.ok()) return done(b.status());
    bind = *b;
  }
  const std::string fp = Fingerprint(spec, req.volume_capability(), req.readonly(), req.staging_target_path());
  std::string owner;
  const state::Target* existing = FindTargetOwner(target, &owner);
  if (existing != nullptr && owner != id) {
    return done(absl::AlreadyExistsError(
        absl::StrCat("target_path ", target, " is in use by volume ", owner)));
  }
  if (auto s = CheckPathFree(target, id, "target_path"); !s.ok()) return done(s);
  if (existing != nullptr && existing->fingerprint() != fp) {
    return done(absl::AlreadyExistsError(absl::StrCat(
        "volume ", id, " is already published at ", target, " with different parameters")));
  }
  if (it != volumes_.end()) {
    previous = it->second;
    v = it->second;
  } else {
    v.set_volume_id(id);
    ApplySpec(spec, &v);
  }
  int index = -1;
  for (int i = 0; i < v.targets_size(); ++i) {
    if (v.targets(i).path() == target) index = i;
  }
  const bool repeat = index >= 0;
  if (index < 0) {
    state::Target* t = v.add_targets();
    t->set_path(target);
    t->set_readonly(bind ? bind->read_only : req.readonly());
    t->set_fingerprint(fp);
    t->set_pod_namespace(Get(req.volume_context(), kPodNamespaceKey));
    t->set_pod_name(Get(req.volume_context(), kPodNameKey));
    t->set_pod_uid(Get(req.volume_context(), kPodUidKey));
    index = v.targets_size() - 1;
  }
  if (auto s = Claim(id); !s.ok()) return done(s);
  if (fuse_inline) {
    if (repeat) {
      Release(id);
      return done(absl::OkStatus());
    }
    const std::string pod_uid = Get(req.volume_context(), kPodUidKey);
    absl::Status bad;
    if (auto s = CheckName(pod_uid, kPodUidKey); !s.ok()) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "inline FUSE volumes need the pod's uid in volume_context (CSIDriver podInfoOnMount: true): ",
          s.message()));
    } else if (auto s2 = CheckName(spec.socket_volume, "volume_context.socketVolume"); !s2.ok()) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "inline FUSE volumes need volume_context.socketVolume, the emptyDir shared with the "
          "server sidecar: ", s2.message()));
    }
    if (!bad.ok()) {
      Release(id);
      return done(bad);
    }
    v.mutable_fuse()->set_socket_path(absl::StrCat(kubelet_.path(), "/pods/", pod_uid,
                                                   "/volumes/kubernetes.io~empty-dir/", spec.socket_volume,
                                                   "/", spec.socket_name));
    return PublishFuseInline(req, std::move(v), index, std::move(previous), std::move(done));
  }
  // A repeat of a completed publish re-checks the mount (PublishBlocking adopts it).
  RunVolumeJob(
      id, "NodePublishVolume",
      [ctx = ctx_, v = std::move(v), index, previous = std::move(previous), bind = *bind]() mutable
      -> absl::StatusOr<std::optional<state::Volume>> {
        auto r = PublishBlocking(ctx, std::move(v), index, std::move(previous), bind);
        if (!r.ok()) return r.status();
        return std::optional<state::Volume>(std::move(*r));
      },
      std::move(done));
}

void VolumeManager::PublishFuseInline(const csi::v1::NodePublishVolumeRequest& req, state::Volume v,
                                      int index, std::optional<state::Volume> previous, Done done) {
  auto [secrets, options] = ServerInputs(req);
  const std::string id = v.volume_id();
  const std::string target = v.targets(index).path();
  RunJob<std::shared_ptr<FuseMounted>>(
      id, "NodePublishVolume (fuse)",
      [ctx = ctx_, v = std::move(v), index, previous = std::move(previous)]() mutable
      -> absl::StatusOr<std::shared_ptr<FuseMounted>> {
        auto m = MountFuseVolumeBlocking(ctx, std::move(v), index, std::move(previous), true);
        if (!m.ok()) return m.status();
        return std::make_shared<FuseMounted>(std::move(*m));
      },
      [this, secrets, options, target](std::shared_ptr<FuseMounted> m) {
        volumes_[m->volume.volume_id()] = m->volume;
        StartEndpoint(m->volume, target, std::move(m->fuse_fd), std::move(m->listen_fd), secrets, options);
        return absl::OkStatus();
      },
      std::move(done));
}

void VolumeManager::Unpublish(const csi::v1::NodeUnpublishVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  if (WaitTurn(id, req, done, &VolumeManager::Unpublish)) return;
  const std::string& target = req.target_path();
  if (auto rel = kubelet_.Relative(target, "target_path"); !rel.ok()) return done(rel.status());
  if (auto s = Claim(id); !s.ok()) return done(s);
  auto it = volumes_.find(id);
  const state::Target* known = nullptr;
  if (it != volumes_.end()) {
    for (const auto& t : it->second.targets()) {
      if (t.path() == target) known = &t;
    }
  }
  if (known == nullptr) {
    // A repeat (already unpublished) or a target we never published: OK if nothing is mounted.
    std::optional<state::Volume> keep;
    if (it != volumes_.end()) keep = it->second;
    return RunVolumeJob(
        id, "NodeUnpublishVolume",
        [ctx = ctx_, target, id, keep]() -> absl::StatusOr<std::optional<state::Volume>> {
          if (auto s = ForgetUnknownPathBlocking(ctx, target, id, /*remove_dir=*/true); !s.ok()) return s;
          return keep;
        },
        std::move(done));
  }
  const bool fuse_inline = IsFuse(it->second) && it->second.staging_path().empty();
  if (fuse_inline) StopEndpoint(id, target);
  RunVolumeJob(
      id, "NodeUnpublishVolume",
      [ctx = ctx_, v = it->second, target, fuse_inline, id_of_mount = known->mount(),
       base = TargetBase(*known)]() mutable -> absl::StatusOr<std::optional<state::Volume>> {
        if (fuse_inline) {
          // The pod is going away with its sidecar: abort the connection, then unmount.
          if (auto s = TearDownFuseMountBlocking(ctx, target, id_of_mount, base, v, true); !s.ok()) return s;
        }
        return UnpublishBlocking(ctx, std::move(v), target);
      },
      std::move(done));
}

void VolumeManager::Stats(const csi::v1::NodeGetVolumeStatsRequest& req, StatsDone done) {
  if (!ready_) return done(absl::UnavailableError("fusekeeper is still reconciling volume state; retry"));
  auto it = volumes_.find(req.volume_id());
  if (it == volumes_.end()) {
    return done(absl::NotFoundError(absl::StrCat("volume ", req.volume_id(), " is not known on this node")));
  }
  const state::Volume& v = it->second;
  const std::string& path = req.volume_path();
  state::MountIdentity id;
  std::string mount_path = path;
  bool found = false;
  for (const auto& t : v.targets()) {
    if (t.path() == path && !t.pending()) {
      id = t.mount();
      found = true;
    }
  }
  if (!found && path == v.staging_path() && !v.staging_pending()) {
    id = v.staging_mount();
    mount_path = StagingMountPath(v);
    found = true;
  }
  if (!found) {
    return done(absl::NotFoundError(absl::StrCat("volume ", req.volume_id(), " is not mounted at ", path)));
  }
  if (IsFuse(v)) {
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
      return Probe(path, mount_path, id,
                   [socket, done = std::move(done)](absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse> r) mutable {
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
      resp.mutable_volume_condition()->set_message(absl::StrCat(
          "no FUSE server has connected to ", v.fuse().socket_path(), " yet"));
      return done(resp);
    }
  }
  Probe(path, mount_path, id, std::move(done));
}

void VolumeManager::Probe(const std::string& path, const std::string& mount_path,
                          const state::MountIdentity& id, StatsDone done) {
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
  auto race = std::make_shared<ProbeRace>();
  race->dones.push_back(std::move(done));
  const absl::Duration timeout = options_.stats_timeout;
  race->timer = loop_.AddTimer(absl::ToChronoNanoseconds(timeout), [race, path, timeout] {
    if (race->answered) return;
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
      [ctx = ctx_, race, mount_path, id] { race->result = StatsBlocking(ctx, mount_path, id); },
      [this, race, mount_path](absl::Status ran) {
        probes_outstanding_.erase(mount_path);
        if (race->answered) return;  // the deadline answered already
        loop_.CancelTimer(race->timer);
        race->Answer(ran.ok() ? std::move(race->result) : ran);
      });
  if (!s.ok()) {
    probes_outstanding_.erase(mount_path);
    loop_.CancelTimer(race->timer);
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
