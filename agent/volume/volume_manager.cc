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
namespace {

using csi::v1::VolumeCapability;

// Whether `a` and `b` are the same path or one lies inside the other.
bool Overlaps(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  return IsAtOrBelow(a, b) || IsAtOrBelow(b, a);
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
      claims_(loop, ClaimQueue::Options{.max_queued_per_volume = options.max_queued_per_volume,
                                        .max_wait = options.max_queue_wait}),
      audit_retry_(loop),
      own_probe_pool_(probe_pool != nullptr
                          ? nullptr
                          : std::make_unique<BlockingPool>(
                                loop, BlockingPoolOptions{.threads = options.probe_threads,
                                                          .max_threads = options.max_probe_threads,
                                                          .max_queued = 1024})),
      probe_pool_(probe_pool != nullptr ? probe_pool : own_probe_pool_.get()) {
}

void VolumeManager::AddKind(std::unique_ptr<VolumeKind> kind) {
  CHECK(!ready_) << "kinds are added before Start";
  std::string name(kind->name());
  kinds_[std::move(name)] = std::move(kind);
}

void VolumeManager::Start(Done done) {
  struct Loaded {
    // A state that cannot be read now (the agent out of fds, a directory it cannot list) fails
    // the start: going on without it would forget volumes that are mounted.
    absl::StatusOr<std::vector<state::Volume>> volumes;
    std::vector<std::string> problems;
  };
  auto loaded = std::make_shared<Loaded>();
  absl::Status submitted = pool_.Submit(
      "load state",
      [this, loaded] {
        loaded->volumes = store_.LoadAllBlocking(&loaded->problems);
      },
      [this, loaded, done = std::move(done)](absl::Status s) mutable {
        if (!s.ok()) return done(s);
        for (const auto& p : loaded->problems) LOG(WARNING) << p;
        if (!loaded->volumes.ok()) {
          return done(absl::Status(loaded->volumes.status().code(),
                                   absl::StrCat("loading the volume state: ", loaded->volumes.status().message())));
        }
        table_reader_.Read([this, loaded, done = std::move(done)](
                               absl::StatusOr<std::shared_ptr<const MountTable>> table) mutable {
          if (!table.ok()) return done(table.status());
          std::vector<state::Volume> known;
          for (auto& v : *loaded->volumes) {
            if (kinds_.count(v.kind().empty() ? kHostPathKind : v.kind()) == 0) {
              // State of a newer agent (a rollback): its file and mounts are left as they are.
              LOG(WARNING) << "volume " << v.volume_id() << " has kind '" << v.kind()
                           << "', which this agent does not know; its state and mounts are left alone";
              continue;
            }
            known.push_back(std::move(v));
          }
          ReconcileOutcome outcome =
              Reconcile(std::move(known), **table,
                        [this](const std::string& p) { return kubelet_.MountTablePath(p); });
          for (const auto& note : outcome.notes) LOG(INFO) << "reconcile: " << note;
          auto save = std::make_shared<ReconcileOutcome>(std::move(outcome));
          absl::Status sub = pool_.Submit(
              "re-identify mounts, save reconciled state",
              [this, save] {
                // This agent may run in another mount namespace than the one that recorded the
                // mount ids (a container restart): every id is looked up again (mount_stack.h).
                std::set<std::string> changed;
                for (const auto& v : save->save) changed.insert(v.volume_id());
                int reidentified = 0;
                for (auto& v : save->volumes) {
                  if (ReidentifyVolumeBlocking(ctx_, &v)) {
                    changed.insert(v.volume_id());
                    ++reidentified;
                  }
                }
                if (reidentified > 0) {
                  LOG(INFO) << "mount ids of " << reidentified << " volume(s) looked up again in this mount namespace";
                }
                for (const auto& v : save->volumes) {
                  if (changed.count(v.volume_id()) == 0) continue;
                  if (auto s = store_.SaveBlocking(v); !s.ok()) LOG(ERROR) << s;
                }
                for (const auto& id : save->remove) {
                  if (auto s = store_.RemoveBlocking(id); !s.ok()) LOG(ERROR) << s;
                }
                for (auto& [name, kind] : kinds_) kind->StartingBlocking();
              },
              [this, save, done = std::move(done)](absl::Status s) mutable {
                for (auto& v : save->volumes) volumes_[v.volume_id()] = std::move(v);
                ready_ = s.ok();
                LOG(INFO) << "volume state reconciled: " << volumes_.size() << " volumes";
                if (ready_) {
                  for (auto& [name, kind] : kinds_) kind->Started();
                }
                done(s);
              });
          if (!sub.ok()) LOG(ERROR) << sub;
        });
      });
  if (!submitted.ok()) LOG(ERROR) << submitted;
}

bool VolumeManager::Busy(const std::string& volume_id) const { return claims_.Busy(volume_id); }

ClaimQueue::Claim VolumeManager::TryClaim(const std::string& volume_id) {
  if (!ready_) return Claim();
  return claims_.TryAcquire(volume_id, "");
}

const state::Volume* VolumeManager::Find(const std::string& volume_id) const {
  auto it = volumes_.find(volume_id);
  return it == volumes_.end() ? nullptr : &it->second;
}

void VolumeManager::RunClaimed(Claim claim, KindJob job, absl::AnyInvocable<void(absl::Status)> done) {
  RunJob(std::move(claim), std::move(job), std::move(done), /*answer_from_pool=*/false);
}

void VolumeManager::RunRpcJob(Claim claim, absl::StatusOr<KindJob> job, Done done) {
  if (!job.ok()) {
    claim.Release();
    return done(job.status());
  }
  RunJob(std::move(claim), std::move(*job), std::move(done), /*answer_from_pool=*/true);
}

void VolumeManager::RunJob(Claim claim, KindJob job, absl::AnyInvocable<void(absl::Status)> done,
                           bool answer_from_pool) {
  CHECK(claim) << "a job runs under a claim";
  const std::string volume_id = claim.volume_id();
  const std::string target = claim.target();
  if (job.before) {
    RunBefore(std::move(claim), std::move(job), std::move(done), answer_from_pool);
    return;
  }
  if (!job.work) {
    claim.Release();
    if (done) done(absl::OkStatus());
    return;
  }
  struct Running {
    absl::AnyInvocable<absl::StatusOr<AdoptFn>()> work;
    absl::StatusOr<AdoptFn> result = absl::UnknownError("not run");
    absl::AnyInvocable<void(absl::Status)> done;
    absl::AnyInvocable<void()> undo;
    bool ran = false;
  };
  auto r = std::make_shared<Running>();
  r->work = std::move(job.work);
  r->done = std::move(done);
  r->undo = std::move(job.undo);
  // The claim stays on the loop thread while the work runs on the pool.
  const uint64_t job_number = ++next_job_;
  running_claims_.emplace(job_number, std::move(claim));
  // On the loop: record the state the job left, end the claim (the next operation on the volume
  // sees that state), and (unless the pool thread answered already) pass the outcome on.
  auto finish = [this, volume_id, target, job_number](const std::shared_ptr<Running>& r, bool answer) {
    const absl::Status outcome = r->result.status();
    if (!outcome.ok() && r->undo) r->undo();
    if (outcome.ok()) RecordChange(volume_id, target, (*r->result)());
    running_claims_.erase(job_number);
    if (answer && r->done) r->done(outcome);
  };
  absl::Status s = pool_.Submit(
      std::move(job.reason),
      [this, r, finish, answer_from_pool]() mutable {
        r->result = r->work();
        r->ran = true;
        if (!answer_from_pool) return;
        // The RPC is answered from here, saving the hop back through the loop. Its outcome is
        // posted to the loop first: anything the caller sends once it has the answer is queued
        // behind it, so it sees the state this job left.
        const absl::Status outcome = r->result.status();
        if (!loop_.Post([r, finish]() mutable { finish(r, /*answer=*/false); })) {
          r->done(absl::UnavailableError("fusekeeper is shutting down"));
          return;
        }
        r->done(outcome);
      },
      [this, r, finish, answer_from_pool, job_number](absl::Status ran) mutable {
        if (!ran.ok() || !r->ran) {  // the pool shut down before the work started
          if (r->undo) r->undo();
          running_claims_.erase(job_number);
          if (r->done) r->done(ran.ok() ? absl::CancelledError("not run") : ran);
          return;
        }
        if (!answer_from_pool) finish(r, /*answer=*/true);
      });
  if (!s.ok()) {
    if (r->undo) r->undo();
    running_claims_.erase(job_number);
    if (r->done) r->done(s);
  }
}

// A job's before-step runs first (on the loop, asynchronously); the job goes on only if it
// succeeded, and otherwise ends with its error and its claim released.
void VolumeManager::RunBefore(Claim claim, KindJob job, absl::AnyInvocable<void(absl::Status)> done,
                              bool answer_from_pool) {
  auto before = std::move(job.before);
  job.before = nullptr;
  auto rest = std::make_shared<std::tuple<Claim, KindJob, absl::AnyInvocable<void(absl::Status)>>>(
      std::move(claim), std::move(job), std::move(done));
  before([this, rest, answer_from_pool](absl::Status s) mutable {
    auto& [claim, job, done] = *rest;
    if (!s.ok()) {
      claim.Release();
      if (done) done(std::move(s));
      return;
    }
    RunJob(std::move(claim), std::move(job), std::move(done), answer_from_pool);
  });
}

void VolumeManager::RecordChange(const std::string& volume_id, const std::string& target, VolumeChange change) {
  if (!target.empty() && change.what == VolumeChange::kSet) {
    // Work on one target of a staged volume, beside others: only that target is taken from the
    // job's copy (see Publish).
    RecordTarget(volume_id, change.volume, target);
  } else if (change.what == VolumeChange::kSet) {
    volumes_[volume_id] = std::move(change.volume);
  } else if (change.what == VolumeChange::kErase) {
    volumes_.erase(volume_id);
  }
}

void VolumeManager::RecordTarget(const std::string& volume_id, const state::Volume& from, const std::string& path) {
  auto it = volumes_.find(volume_id);
  if (it == volumes_.end()) return;  // cannot happen: unstaging needs the whole volume's claim
  const state::Target* mine = nullptr;
  for (const auto& t : from.targets()) {
    if (t.path() == path) mine = &t;
  }
  auto* targets = it->second.mutable_targets();
  for (int i = 0; i < targets->size(); ++i) {
    if (targets->Get(i).path() != path) continue;
    if (mine != nullptr) {
      *targets->Mutable(i) = *mine;
    } else {
      targets->DeleteSubrange(i, 1);
    }
    return;
  }
  if (mine != nullptr) *it->second.add_targets() = *mine;
}

absl::StatusOr<VolumeKind*> VolumeManager::KindFor(
    const google::protobuf::Map<std::string, std::string>& volume_context) const {
  const std::string name = ContextValue(volume_context, "kind");
  auto it = kinds_.find(name);
  if (it != kinds_.end()) return it->second.get();
  std::vector<std::string> names;
  for (const auto& [n, k] : kinds_) names.push_back(n);
  const std::string supported = absl::StrJoin(names, ", ");
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("volume_context.kind is required (supported: ", supported, ")"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("volume_context.kind '", name, "' is not supported (supported: ", supported, ")"));
}

VolumeKind& VolumeManager::KindOf(const state::Volume& v) const {
  auto it = kinds_.find(v.kind().empty() ? kHostPathKind : v.kind());
  // Start leaves out state of kinds this agent does not know, so every recorded kind is here.
  CHECK(it != kinds_.end()) << "volume " << v.volume_id() << " has unknown kind " << v.kind();
  return *it->second;
}

absl::StatusOr<state::Spec> VolumeManager::RequestSpec(
    VolumeKind& kind, const google::protobuf::Map<std::string, std::string>& volume_context,
    const VolumeCapability& cap, bool staged) const {
  state::Spec spec;
  spec.set_kind(std::string(kind.name()));
  if (auto s = kind.ParseSpec(volume_context, cap, staged, &spec); !s.ok()) return s;
  return spec;
}

void VolumeManager::Stage(const csi::v1::NodeStageVolumeRequest& req, Done done) {
  WithClaim(req.volume_id(), "", req, std::move(done), &VolumeManager::StageClaimed);
}

void VolumeManager::StageClaimed(Claim claim, const csi::v1::NodeStageVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  auto kind = KindFor(req.volume_context());
  if (!kind.ok()) return done(kind.status());
  auto spec = RequestSpec(**kind, req.volume_context(), req.volume_capability(), /*staged=*/true);
  if (!spec.ok()) return done(spec.status());
  if (auto rel = kubelet_.Relative(req.staging_target_path(), "staging_target_path"); !rel.ok()) {
    return done(rel.status());
  }
  if (auto s = CheckPathFree(req.staging_target_path(), id, "staging_target_path"); !s.ok()) return done(s);
  const std::string fp = RequestFingerprint(*spec, req.volume_capability(), false, "");
  StageCall call{&req};
  auto it = volumes_.find(id);
  if (it != volumes_.end()) {
    call.previous = it->second;
    call.volume = it->second;
    const state::Volume& v = it->second;
    if (!v.staging_path().empty()) {
      if (v.staging_path() != req.staging_target_path()) {
        return done(absl::AlreadyExistsError(absl::StrCat("volume ", id, " is already staged at ", v.staging_path())));
      }
      if (v.staging_fingerprint() != fp) {
        return done(absl::AlreadyExistsError(
            absl::StrCat("volume ", id, " is already staged at this path with different parameters")));
      }
      call.repeat = true;
    } else if (v.targets_size() > 0) {
      return done(absl::AlreadyExistsError(
          absl::StrCat("volume ", id, " is published as an ephemeral (unstaged) volume")));
    }
  } else {
    call.volume.set_volume_id(id);
  }
  (*kind)->ApplySpec(*spec, &call.volume);
  call.volume.set_staging_path(req.staging_target_path());
  call.volume.set_staging_fingerprint(fp);
  RunRpcJob(std::move(claim), (*kind)->Stage(std::move(call)), std::move(done));
}

void VolumeManager::Unstage(const csi::v1::NodeUnstageVolumeRequest& req, Done done) {
  WithClaim(req.volume_id(), "", req, std::move(done), &VolumeManager::UnstageClaimed);
}

void VolumeManager::UnstageClaimed(Claim claim, const csi::v1::NodeUnstageVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  if (auto rel = kubelet_.Relative(req.staging_target_path(), "staging_target_path"); !rel.ok()) {
    return done(rel.status());
  }
  auto it = volumes_.find(id);
  if (it == volumes_.end() || it->second.staging_path().empty()) {
    // Already unstaged (a repeat), or never staged by us: OK if nothing is mounted there.
    std::optional<state::Volume> keep;
    if (it != volumes_.end()) keep = it->second;
    return RunRpcJob(std::move(claim),
                      StateJob("NodeUnstageVolume",
                               [ctx = ctx_, path = req.staging_target_path(), id,
                                keep]() -> absl::StatusOr<std::optional<state::Volume>> {
                                 if (auto s = ForgetUnknownPathBlocking(ctx, path, id, /*remove_dir=*/false); !s.ok()) {
                                   return s;
                                 }
                                 return keep;
                               }),
                      std::move(done));
  }
  const state::Volume& v = it->second;
  if (v.staging_path() != req.staging_target_path()) {
    return done(absl::NotFoundError(absl::StrCat("volume ", id, " is staged at ", v.staging_path(), ", not at ",
                                                 req.staging_target_path())));
  }
  if (v.targets_size() > 0) {
    return done(absl::FailedPreconditionError(absl::StrCat("volume ", id, " is still published at ", v.targets_size(),
                                                           " target(s), e.g. ", v.targets(0).path(),
                                                           "; unpublish them first")));
  }
  RunRpcJob(std::move(claim), KindOf(v).Unstage(v), std::move(done));
}

void VolumeManager::Publish(const csi::v1::NodePublishVolumeRequest& req, Done done) {
  // Publishes of distinct targets of a staged volume run side by side, each under its target's
  // claim (state writes touch only their own target: StateStore::SaveTargetBlocking); anything
  // else on the volume, and the same target again, waits its turn.
  const std::string scope = req.staging_target_path().empty() ? "" : req.target_path();
  WithClaim(req.volume_id(), scope, req, std::move(done), &VolumeManager::PublishClaimed);
}

// Which kind publishes `req` and with what spec: the staged volume's (`recorded`), or the
// request's own for a volume published without staging. `recorded` is the volume as recorded,
// or null. An error says why the request cannot be published.
absl::StatusOr<VolumeManager::PublishPlan> VolumeManager::PublishSpec(const csi::v1::NodePublishVolumeRequest& req,
                                                                     state::Volume* recorded) const {
  const std::string& id = req.volume_id();
  PublishPlan plan;
  if (!req.staging_target_path().empty()) {
    if (recorded == nullptr || recorded->staging_path().empty()) {
      return absl::NotFoundError(absl::StrCat("volume ", id, " is not staged on this node"));
    }
    if (recorded->staging_path() != req.staging_target_path()) {
      return absl::FailedPreconditionError(absl::StrCat("volume ", id, " is staged at ",
                                                      recorded->staging_path(), ", not at ",
                                                      req.staging_target_path()));
    }
    plan.kind = &KindOf(*recorded);
    plan.spec = StagedSpec(*recorded, std::string(plan.kind->name()));
    if (auto s = plan.kind->CheckPublish(req, recorded, plan.spec, &plan.read_only); !s.ok()) return s;
  } else {
    auto k = KindFor(req.volume_context());
    if (!k.ok()) return k.status();
    plan.kind = *k;
    auto parsed = RequestSpec(*plan.kind, req.volume_context(), req.volume_capability(), /*staged=*/false);
    if (!parsed.ok()) return parsed.status();
    plan.spec = std::move(*parsed);
    if (auto s = plan.kind->CheckPublish(req, nullptr, plan.spec, &plan.read_only); !s.ok()) return s;
    if (recorded != nullptr && !recorded->staging_path().empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "volume ", id, " is staged at ", recorded->staging_path(),
          "; NodePublishVolume must pass that staging_target_path"));
    }
    if (recorded != nullptr && (recorded->kind() != plan.spec.kind() || recorded->host_path() != plan.spec.host_path() ||
                                recorded->host_path_type() != plan.spec.host_path_type())) {
      return absl::AlreadyExistsError(
          absl::StrCat("volume ", id, " is already published with a different volume_context"));
    }
  }
  return plan;
}

void VolumeManager::PublishClaimed(Claim claim, const csi::v1::NodePublishVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  const std::string& target = req.target_path();
  if (auto rel = kubelet_.Relative(target, "target_path"); !rel.ok()) return done(rel.status());
  if (!req.staging_target_path().empty()) {
    if (auto rel = kubelet_.Relative(req.staging_target_path(), "staging_target_path"); !rel.ok()) {
      return done(rel.status());
    }
  }
  auto it = volumes_.find(id);
  auto plan = PublishSpec(req, it == volumes_.end() ? nullptr : &it->second);
  if (!plan.ok()) return done(plan.status());
  VolumeKind* kind = plan->kind;
  const state::Spec& spec = plan->spec;
  const bool read_only = plan->read_only;
  const std::string fp = RequestFingerprint(spec, req.volume_capability(), req.readonly(), req.staging_target_path());
  std::string owner;
  const state::Target* existing = FindTargetOwner(target, &owner);
  if (existing != nullptr && owner != id) {
    return done(absl::AlreadyExistsError(absl::StrCat("target_path ", target, " is in use by volume ", owner)));
  }
  if (auto s = CheckPathFree(target, id, "target_path"); !s.ok()) return done(s);
  if (existing != nullptr && existing->fingerprint() != fp) {
    return done(absl::AlreadyExistsError(
        absl::StrCat("volume ", id, " is already published at ", target, " with different parameters")));
  }
  PublishCall call{&req};
  if (it != volumes_.end()) {
    call.previous = it->second;
    call.volume = it->second;
  } else {
    call.volume.set_volume_id(id);
    kind->ApplySpec(spec, &call.volume);
  }
  state::Volume& v = call.volume;
  for (int i = 0; i < v.targets_size(); ++i) {
    if (v.targets(i).path() == target) call.index = i;
  }
  call.repeat = call.index >= 0;
  if (!call.repeat) {
    state::Target* t = v.add_targets();
    t->set_path(target);
    t->set_readonly(read_only);
    t->set_fingerprint(fp);
    t->set_pod_namespace(ContextValue(req.volume_context(), kPodNamespaceKey));
    t->set_pod_name(ContextValue(req.volume_context(), kPodNameKey));
    t->set_pod_uid(ContextValue(req.volume_context(), kPodUidKey));
    call.index = v.targets_size() - 1;
  }
  RunRpcJob(std::move(claim), kind->Publish(std::move(call)), std::move(done));
}

void VolumeManager::Unpublish(const csi::v1::NodeUnpublishVolumeRequest& req, Done done) {
  // A target of a staged volume: only that target's claim (see Publish).
  auto staged = volumes_.find(req.volume_id());
  const bool target_scope = staged != volumes_.end() && !staged->second.staging_path().empty();
  WithClaim(req.volume_id(), target_scope ? req.target_path() : "", req, std::move(done),
            &VolumeManager::UnpublishClaimed);
}

void VolumeManager::UnpublishClaimed(Claim claim, const csi::v1::NodeUnpublishVolumeRequest& req, Done done) {
  const std::string& id = req.volume_id();
  const std::string& target = req.target_path();
  if (auto rel = kubelet_.Relative(target, "target_path"); !rel.ok()) return done(rel.status());
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
    return RunRpcJob(std::move(claim),
                      StateJob("NodeUnpublishVolume",
                               [ctx = ctx_, target, id, keep]() -> absl::StatusOr<std::optional<state::Volume>> {
                                 if (auto s = ForgetUnknownPathBlocking(ctx, target, id, /*remove_dir=*/true); !s.ok()) {
                                   return s;
                                 }
                                 return keep;
                               }),
                      std::move(done));
  }
  RunRpcJob(std::move(claim), KindOf(it->second).Unpublish(it->second, *known), std::move(done));
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

}  // namespace fusekeeper
