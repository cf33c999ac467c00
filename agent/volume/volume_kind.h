// VolumeKind: everything that differs between kinds of volume (hostPath, fuse) sits behind this
// interface, one module per kind, the way Envoy's filters do; VolumeManager holds a registry of
// kinds by the name in volume_context["kind"], sequences the RPCs of each volume, records state and
// answers, and never asks which kind a volume is.
//
// Threading: every method runs on the loop thread and never blocks. Blocking work is returned as
// a KindJob, which the manager runs on the BlockingPool under the volume's claim (so no two pieces
// of work on one volume ever overlap), then runs the job's `adopt` on the loop and records the
// volume state it returns.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "agent/loop/loop.h"
#include "agent/mount/mountinfo.h"
#include "agent/volume/claim_queue.h"
#include "agent/volume/volume_ops.h"
#include "proto/csi.pb.h"
#include "proto/state.pb.h"

namespace fusekeeper {

// The host-path kind's name, which the manager also gives volumes recorded before kinds existed.
inline constexpr char kHostPathKind[] = "hostPath";

// What a finished job did to the volume's state.
struct VolumeChange {
  enum What { kKeep, kSet, kErase };
  What what = kKeep;
  state::Volume volume;  // kSet: the new state (already saved by the job)
  static VolumeChange Keep() { return {}; }
  static VolumeChange Erase() { return {kErase, {}}; }
  static VolumeChange Set(state::Volume v) { return {kSet, std::move(v)}; }
};

// Runs on the loop after a job's work succeeded (the claim is still held): starts endpoints,
// updates the kind's own bookkeeping, and returns what became of the volume's state.
using AdoptFn = absl::AnyInvocable<VolumeChange()>;

struct KindJob {
  std::string reason;  // names the pool job in logs and metrics
  // BlockingPool; may block. Empty: nothing to do (the RPC answers OK at once).
  absl::AnyInvocable<absl::StatusOr<AdoptFn>()> work;
  // Optional, on the loop, under the claim, before `work`: asynchronous preparation (a request
  // to the API server). It calls its argument once with the outcome; an error ends the job with
  // that error and `work` does not run.
  absl::AnyInvocable<void(absl::AnyInvocable<void(absl::Status)>)> before;
  // Optional, on the loop: undoes what `before` did, when `work` then fails.
  absl::AnyInvocable<void()> undo;
};

// A job whose work returns the new state directly (nullopt: the volume is gone).
KindJob StateJob(std::string reason, absl::AnyInvocable<absl::StatusOr<std::optional<state::Volume>>()> work);

using StatsResult = absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse>;
using StatsDone = absl::AnyInvocable<void(StatsResult)>;

// What the manager offers the kinds. Loop thread only.
class VolumeHost {
 public:
  virtual ~VolumeHost() = default;
  virtual Loop& loop() = 0;
  virtual const VolumeOpsContext& ops_context() const = 0;
  virtual const std::map<std::string, state::Volume>& volumes() const = 0;
  // The volume's recorded state, or null.
  virtual const state::Volume* Find(const std::string& volume_id) const = 0;
  // Whether an RPC or a repair holds the volume's claim.
  virtual bool Busy(const std::string& volume_id) const = 0;
  // The volume's whole claim for work that is not an RPC (a repair, a timeout's clean-up), if it
  // is free and no RPC waits for it; empty otherwise (or if the manager is not ready). The claim
  // ends when the handle is dropped: pass it to RunClaimed.
  virtual ClaimQueue::Claim TryClaim(const std::string& volume_id) = 0;
  // Runs `job` under `claim`, records the state its adopt returns, ends the claim and passes the
  // outcome to `done` (on the loop; may be empty).
  virtual void RunClaimed(ClaimQueue::Claim claim, KindJob job, absl::AnyInvocable<void(absl::Status)> done) = 0;
  // statfs of the mount at `mount_path` (which must be `mounts.top`, on `mounts.base`) on the
  // probe pool, answered within the stats deadline: abnormal if it does not answer. `path` names
  // it in messages.
  virtual void Probe(const std::string& path, const std::string& mount_path, const PathMounts& mounts,
                     StatsDone done) = 0;
  // A Kubernetes Event for every pod the volume is published to (and a log line).
  virtual void Event(const state::Volume& v, const std::string& type, const std::string& reason,
                     const std::string& message) = 0;
  // Every pod the volume is published to is terminating (and there is at least one).
  virtual bool AllPodsTerminating(const state::Volume& v) const = 0;
  // Reads the kubelet's pod list again now, then calls `done` (on the loop) with what it says
  // taken in (AllPodsTerminating); at once if the agent does not poll the kubelet.
  virtual void RefreshPods(absl::AnyInvocable<void()> done) = 0;
  // A recovery finished: outcome "recovered" or "failed".
  virtual void RecoveryFinished(const std::string& how, const std::string& outcome, absl::Duration latency) = 0;
};

// One NodeStageVolume, validated by the manager (paths, idempotency, conflicts).
struct StageCall {
  const csi::v1::NodeStageVolumeRequest* req;
  state::Volume volume;  // the spec applied, staging path and fingerprint set
  std::optional<state::Volume> previous;  // the state before, if any
  bool repeat = false;  // staged already with the same parameters
};

// One NodePublishVolume, validated by the manager. volume.targets(index) is the target.
struct PublishCall {
  const csi::v1::NodePublishVolumeRequest* req;
  state::Volume volume;
  int index = -1;
  std::optional<state::Volume> previous;
  bool repeat = false;  // published there already with the same parameters
};

// Counts by state for metrics.
struct VolumeCounts {
  std::map<std::string, int> volumes_by_kind_state;  // "fuse/serving", "hostPath/mounted", ...
  int handoffs_waiting = 0;
  int repairs_in_progress = 0;
  int relayed = 0;  // served through a relay that restarts its program (fkserve launch)
  // Since start: connections aborted because their FUSE server took them and never answered
  // (FuseKindOptions::init_timeout).
  int64_t servers_not_answering = 0;
  // Since start: per-volume FUSE tuning written to a connection, or refused by the kernel.
  int64_t fuse_tunings_applied = 0;
  int64_t fuse_tunings_failed = 0;
  // FUSE passthrough (agent/fuse/backing_broker.h): backing files held on serving connections now,
  // and since start registered, refused and closed.
  int64_t passthrough_held = 0;
  int64_t passthrough_registered = 0, passthrough_refused = 0, passthrough_closed = 0;
};

class VolumeKind {
 public:
  virtual ~VolumeKind() = default;
  // The name in volume_context["kind"].
  virtual absl::string_view name() const = 0;

  // Validates volume_context and the capability for this kind, and fills the kind's fields of
  // `spec` (which is fingerprinted: equal specs are repeats, different ones conflicts).
  // `staged`: for NodeStageVolume (else an unstaged NodePublishVolume).
  virtual absl::Status ParseSpec(const google::protobuf::Map<std::string, std::string>& volume_context,
                                 const csi::v1::VolumeCapability& cap, bool staged, state::Spec* spec) const = 0;
  // Writes the spec's fields into the volume's state.
  virtual void ApplySpec(const state::Spec& spec, state::Volume* v) const = 0;

  virtual absl::StatusOr<KindJob> Stage(StageCall call) = 0;
  // Checks a publish may go ahead before anything is recorded; `staged` is the staged volume, or
  // null for an unstaged publish (whose spec is `spec`). Sets whether the target is read-only.
  virtual absl::Status CheckPublish(const csi::v1::NodePublishVolumeRequest& req, const state::Volume* staged,
                                    const state::Spec& spec, bool* read_only) const = 0;
  virtual absl::StatusOr<KindJob> Publish(PublishCall call) = 0;
  // Unpublishes target `t` of `v` (one the volume recorded).
  virtual KindJob Unpublish(const state::Volume& v, const state::Target& t) = 0;
  // Unstages `v`, which has no targets left.
  virtual KindJob Unstage(const state::Volume& v) = 0;
  // NodeGetVolumeStats of the mount at `path` (at `mount_path`, recorded as `mounts`). The
  // default probes it through the host.
  virtual void Stats(const state::Volume& v, const std::string& path, const std::string& mount_path,
                     const PathMounts& mounts, StatsDone done);

  // --- Recovery; the defaults do nothing. ---
  // BlockingPool, once, while start-up reconciles the saved state (before Started and before any
  // RPC): removes what a killed agent left outside the recorded state (temporary files). The
  // agent holds its state dir's lock, so no live agent made them.
  virtual void StartingBlocking() {}
  // After start-up reconciled the saved state.
  virtual void Started() {}
  // A look at the mount table: repairs what is broken in `v`. False: the volume is busy (an RPC
  // holds its claim) and was not looked at; the manager audits again soon.
  virtual bool Audit(const MountTable& table, const state::Volume& v, const std::string& why) { return true; }
  // The kubelet saw a container of `pod_uid` restart.
  virtual void ContainerRestarted(const state::Volume& v, const std::string& pod_uid, const std::string& container) {}
  // Adds the volume to the metrics' counts.
  virtual void Count(const state::Volume& v, VolumeCounts* counts) const;
  // Adds the kind's own totals (not per volume) to the metrics' counts, once per collection.
  virtual void CountKind(VolumeCounts* counts) const {}

 protected:
  explicit VolumeKind(VolumeHost& host) : host_(host) {}
  VolumeHost& host_;
};

}  // namespace fusekeeper
