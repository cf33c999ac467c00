#include "agent/volume/volume_manager.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "agent/paths/host_path.h"
#include "agent/volume/reconcile.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

using csi::v1::VolumeCapability;

constexpr char kKindHostPath[] = "hostPath";

struct HostPathSpec {
  std::string path;
  std::string type;
};

absl::StatusOr<HostPathSpec> ParseContext(const google::protobuf::Map<std::string, std::string>& ctx) {
  auto get = [&ctx](const char* key) -> std::string {
    auto it = ctx.find(key);
    return it == ctx.end() ? "" : it->second;
  };
  const std::string kind = get("kind");
  if (kind.empty()) {
    return absl::InvalidArgumentError("volume_context.kind is required (supported: hostPath)");
  }
  if (kind != kKindHostPath) {
    return absl::InvalidArgumentError(
        absl::StrCat("volume_context.kind '", kind, "' is not supported (supported: hostPath)"));
  }
  HostPathSpec spec{get("path"), get("type")};
  if (spec.path.empty()) return absl::InvalidArgumentError("volume_context.path is required for hostPath");
  if (auto s = ValidateHostPath(spec.path); !s.ok()) return s;
  if (auto t = ParseHostPathType(spec.type); !t.ok()) return t.status();
  return spec;
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

std::string Fingerprint(const HostPathSpec& spec, const VolumeCapability& cap, bool readonly,
                        const std::string& staging) {
  state::Spec s;
  s.set_kind(kKindHostPath);
  s.set_host_path(spec.path);
  s.set_host_path_type(spec.type);
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

}  // namespace

VolumeManager::VolumeManager(Loop& loop, BlockingPool& pool, const KubeletDir& kubelet,
                             const StateStore& store, MountTableReader& table_reader,
                             VolumeManagerOptions options)
    : loop_(loop),
      pool_(pool),
      kubelet_(kubelet),
      store_(store),
      table_reader_(table_reader),
      options_(options),
      ctx_{&kubelet, &store, options.ephemeral_host_path_prefixes} {}

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

void VolumeManager::RunVolumeJob(
    const std::string& volume_id, std::string reason,
    absl::AnyInvocable<absl::StatusOr<std::optional<state::Volume>>()> work, Done done) {
  auto result = std::make_shared<absl::StatusOr<std::optional<state::Volume>>>(
      absl::UnknownError("not run"));
  auto work_ptr = std::make_shared<decltype(work)>(std::move(work));
  auto finish = [this, volume_id, result](absl::Status ran, Done done) {
    busy_.erase(volume_id);
    if (!ran.ok()) return done(ran);
    if (!result->ok()) return done(result->status());
    if (result->value().has_value()) {
      volumes_[volume_id] = std::move(*result->value());
    } else {
      volumes_.erase(volume_id);
    }
    done(absl::OkStatus());
  };
  auto done_ptr = std::make_shared<Done>(std::move(done));
  absl::Status s = pool_.Submit(
      std::move(reason), [work_ptr, result] { *result = (*work_ptr)(); },
      [finish, done_ptr](absl::Status ran) mutable { finish(ran, std::move(*done_ptr)); });
  if (!s.ok()) {
    busy_.erase(volume_id);
    (*done_ptr)(s);
  }
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

void VolumeManager::Stage(const csi::v1::NodeStageVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  auto spec = ParseContext(req.volume_context());
  if (!spec.ok()) return done(spec.status());
  auto bind = ParseBindOptions(req.volume_capability(), false);
  if (!bind.ok()) return done(bind.status());
  if (auto rel = kubelet_.Relative(req.staging_target_path(), "staging_target_path"); !rel.ok()) {
    return done(rel.status());
  }
  for (const auto& [other, v] : volumes_) {
    if (other != id && v.staging_path() == req.staging_target_path()) {
      return done(absl::AlreadyExistsError(absl::StrCat(
          "staging_target_path ", req.staging_target_path(), " is in use by volume ", other)));
    }
  }
  const std::string fp = Fingerprint(*spec, req.volume_capability(), false, "");
  std::optional<state::Volume> previous;
  state::Volume v;
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
      // A repeat: StageBlocking adopts the existing mount (or remakes a lost one).
    } else if (v.targets_size() > 0) {
      return done(absl::AlreadyExistsError(
          absl::StrCat("volume ", id, " is published as an ephemeral (unstaged) volume")));
    }
  } else {
    v.set_volume_id(id);
  }
  v.set_kind(kKindHostPath);
  v.set_host_path(spec->path);
  v.set_host_path_type(spec->type);
  v.set_staging_path(req.staging_target_path());
  v.set_staging_fingerprint(fp);
  if (auto s = Claim(id); !s.ok()) return done(s);
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

void VolumeManager::Unstage(const csi::v1::NodeUnstageVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
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
  RunVolumeJob(
      id, "NodeUnstageVolume",
      [ctx = ctx_, v]() -> absl::StatusOr<std::optional<state::Volume>> {
        if (auto s = UnstageBlocking(ctx, v); !s.ok()) return s;
        return std::optional<state::Volume>();
      },
      std::move(done));
}

void VolumeManager::Publish(const csi::v1::NodePublishVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  const std::string& target = req.target_path();
  if (auto rel = kubelet_.Relative(target, "target_path"); !rel.ok()) return done(rel.status());
  auto bind = ParseBindOptions(req.volume_capability(), req.readonly());
  if (!bind.ok()) return done(bind.status());
  const bool staged = !req.staging_target_path().empty();
  if (staged) {
    if (auto rel = kubelet_.Relative(req.staging_target_path(), "staging_target_path"); !rel.ok()) {
      return done(rel.status());
    }
  }

  std::optional<state::Volume> previous;
  state::Volume v;
  HostPathSpec spec;
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
    spec = {it->second.host_path(), it->second.host_path_type()};
  } else {
    auto parsed = ParseContext(req.volume_context());
    if (!parsed.ok()) return done(parsed.status());
    spec = *parsed;
    // Unstaged host-path volumes are chosen by pod authors (CSI inline volumes), not by the
    // administrator who creates PersistentVolumes: only allowed below configured prefixes.
    if (!EphemeralHostPathAllowed(ctx_, spec.path)) {
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
    if (it != volumes_.end() && (it->second.host_path() != spec.path ||
                                 it->second.host_path_type() != spec.type)) {
      return done(absl::AlreadyExistsError(
          absl::StrCat("volume ", id, " is already published with a different volume_context")));
    }
  }
  const std::string fp =
      Fingerprint(spec, req.volume_capability(), req.readonly(), req.staging_target_path());
  std::string owner;
  const state::Target* existing = FindTargetOwner(target, &owner);
  if (existing != nullptr && owner != id) {
    return done(absl::AlreadyExistsError(
        absl::StrCat("target_path ", target, " is in use by volume ", owner)));
  }
  if (existing != nullptr && existing->fingerprint() != fp) {
    return done(absl::AlreadyExistsError(absl::StrCat(
        "volume ", id, " is already published at ", target, " with different parameters")));
  }
  if (it != volumes_.end()) {
    previous = it->second;
    v = it->second;
  } else {
    v.set_volume_id(id);
    v.set_kind(kKindHostPath);
    v.set_host_path(spec.path);
    v.set_host_path_type(spec.type);
  }
  int index = -1;
  for (int i = 0; i < v.targets_size(); ++i) {
    if (v.targets(i).path() == target) index = i;
  }
  if (index < 0) {
    state::Target* t = v.add_targets();
    t->set_path(target);
    t->set_readonly(bind->read_only);
    t->set_fingerprint(fp);
    index = v.targets_size() - 1;
  }
  // A repeat of a completed publish re-checks the mount (PublishBlocking adopts it).
  if (auto s = Claim(id); !s.ok()) return done(s);
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

void VolumeManager::Unpublish(const csi::v1::NodeUnpublishVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  const std::string& target = req.target_path();
  if (auto rel = kubelet_.Relative(target, "target_path"); !rel.ok()) return done(rel.status());
  if (auto s = Claim(id); !s.ok()) return done(s);
  auto it = volumes_.find(id);
  bool known_target = false;
  if (it != volumes_.end()) {
    for (const auto& t : it->second.targets()) known_target |= t.path() == target;
  }
  if (!known_target) {
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
  RunVolumeJob(
      id, "NodeUnpublishVolume",
      [ctx = ctx_, v = it->second, target]() mutable {
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
  // Exactly one answer: the statfs result or the deadline, whichever comes first.
  struct Race {
    StatsDone done;
    TimerId timer = 0;
    absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse> result = absl::UnknownError("not run");
  };
  auto race = std::make_shared<Race>();
  race->done = std::move(done);
  const absl::Duration timeout = options_.stats_timeout;
  race->timer = loop_.AddTimer(absl::ToChronoNanoseconds(timeout), [race, path, timeout] {
    if (!race->done) return;
    csi::v1::NodeGetVolumeStatsResponse resp;
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(absl::StrCat(
        "statfs of ", path, " did not answer within ", absl::FormatDuration(timeout),
        ": the mount is unresponsive"));
    std::exchange(race->done, nullptr)(resp);
  });
  absl::Status s = pool_.Submit(
      "NodeGetVolumeStats",
      [ctx = ctx_, race, mount_path, id] { race->result = StatsBlocking(ctx, mount_path, id); },
      [this, race](absl::Status ran) {
        if (!race->done) return;  // the deadline answered already
        loop_.CancelTimer(race->timer);
        std::exchange(race->done, nullptr)(ran.ok() ? std::move(race->result) : ran);
      });
  if (!s.ok()) {
    loop_.CancelTimer(race->timer);
    std::exchange(race->done, nullptr)(s);
  }
}

}  // namespace fusekeeper
