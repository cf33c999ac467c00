// VolumeManager: the Node RPCs' logic, on the loop thread. It owns the in-memory volume state,
// sequences operations per volume (a second RPC for a volume with one in flight waits its turn,
// FIFO and bounded; different volumes never wait on each other), decides idempotent repeats and
// conflicts from that state, and runs each RPC's blocking work on the BlockingPool.
//
// What differs between volume kinds lives in one module per kind behind VolumeKind
// (volume_kind.h): host_path_kind.h and fuse_kind.h. main() builds them and hands them over
// (AddKind); the manager holds them by the name in volume_context["kind"], never asks which kind
// a volume is, and is their VolumeHost.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/strings/str_cat.h"
#include "agent/loop/blocking_pool.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"
#include "agent/mount/table_reader.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/volume/claim_queue.h"
#include "agent/volume/state_store.h"
#include "agent/volume/volume_kind.h"
#include "agent/volume/volume_ops.h"
#include "proto/csi.pb.h"
#include "proto/state.pb.h"

namespace fusekeeper {

// A pod a volume is published to (CSIDriver podInfoOnMount), for Events.
struct PodRef {
  std::string namespace_;
  std::string name;
  std::string uid;
};

// What recovery reports. Loop thread; both may be empty.
struct RecoveryHooks {
  // A Kubernetes Event about `pod` (type "Normal" or "Warning").
  absl::AnyInvocable<void(const PodRef& pod, const std::string& type, const std::string& reason,
                          const std::string& message)>
      on_event;
  // A recovery finished: outcome "recovered" or "failed"; `latency` from detection to the end.
  absl::AnyInvocable<void(const std::string& how, const std::string& outcome, absl::Duration latency)>
      on_recovery;
};

struct VolumeManagerOptions {
  // NodeGetVolumeStats answers `abnormal` if statfs has not returned by then.
  absl::Duration stats_timeout = absl::Seconds(5);
  // See VolumeOpsContext::ephemeral_host_path_prefixes and host_root.
  std::vector<std::string> ephemeral_host_path_prefixes;
  std::string host_root;
  // Threads for file-system probes (statfs), which can hang on an unresponsive FUSE server; kept
  // apart from the mount work's pool so that mount RPCs never wait behind them. The pool grows
  // when every probe thread is stuck (at most one probe per mount is outstanding, so a hung
  // volume costs one parked thread), up to max_probe_threads.
  int probe_threads = 2;
  int max_probe_threads = 1024;
  // RPCs on a volume with an operation in flight wait their turn (FIFO) instead of getting
  // ABORTED, which kubelet would answer with an exponential backoff of up to two minutes. At most
  // max_queued_per_volume wait (more: RESOURCE_EXHAUSTED), each for at most max_queue_wait (then
  // ABORTED naming what it waited behind).
  int max_queued_per_volume = 256;
  absl::Duration max_queue_wait = absl::Seconds(60);
  // An audit that skipped volumes busy with an RPC looks at them again after this.
  absl::Duration audit_retry = absl::Milliseconds(200);
};

class VolumeManager final : public VolumeHost {
 public:
  using Done = absl::AnyInvocable<void(absl::Status)>;
  using StatsDone = fusekeeper::StatsDone;

  // All references must outlive the manager. `probe_pool` runs statfs probes; null: the manager
  // makes its own (options.probe_threads).
  VolumeManager(Loop& loop, BlockingPool& pool, const KubeletDir& kubelet, const StateStore& store,
                MountTableReader& table_reader, VolumeManagerOptions options = {},
                BlockingPool* probe_pool = nullptr);

  // Before Start (any thread that owns the manager then). The kind serves volumes whose
  // volume_context["kind"] is kind->name(); hostPath also serves volumes recorded without a kind.
  void AddKind(std::unique_ptr<VolumeKind> kind);

  // Loop thread. Loads saved state, reconciles it with the mount table (read through the ring),
  // and writes back what changed. RPCs before `done` get UNAVAILABLE.
  void Start(Done done);
  // Any thread.
  bool ready() const { return ready_.load(std::memory_order_acquire); }

  // Loop thread. Requests were validated (csi/validate). `done` must be thread-safe: it runs on
  // the loop thread, or on the pool thread that did the RPC's work, right after the outcome was
  // posted to the loop (so whatever its caller sends next sees that outcome).
  void Stage(const csi::v1::NodeStageVolumeRequest& req, Done done);
  void Unstage(const csi::v1::NodeUnstageVolumeRequest& req, Done done);
  void Publish(const csi::v1::NodePublishVolumeRequest& req, Done done);
  void Unpublish(const csi::v1::NodeUnpublishVolumeRequest& req, Done done);
  void Stats(const csi::v1::NodeGetVolumeStatsRequest& req, StatsDone done);

  size_t volume_count() const { return volumes_.size(); }
  // Loop thread. The pods the kubelet reports as terminating (deletionTimestamp set): a FUSE
  // server of theirs that stops is a pod going away, not a failure.
  void SetTerminatingPods(std::set<std::string> pod_uids) { terminating_pods_ = std::move(pod_uids); }
  // Before the loop runs. How RefreshPods reads the kubelet's pod list now (KubeletPoller's
  // PollNow, which calls SetTerminatingPods before its callback); unset: it is not polled.
  void set_pod_refresher(std::function<void(std::function<void()>)> refresh) { pod_refresher_ = std::move(refresh); }
  // Loop thread. Pod uid → names of the volume directories published into that pod
  // (`…/pods/<uid>/volumes/kubernetes.io~csi/<name>/mount`), for every target that records its pod.
  std::map<std::string, std::set<std::string>> PublishedVolumeDirsByPod() const;

  // --- Recovery (each kind's own; the manager only triggers it) ---
  void set_recovery_hooks(RecoveryHooks hooks) { hooks_ = std::move(hooks); }
  // Loop thread. Reads the mount table (through the ring) and has each volume's kind compare its
  // mounts with it and repair what is broken. Volumes with an RPC in flight are looked at again
  // shortly. `why` names the trigger ("mount table changed", "periodic audit", "start-up").
  void Audit(const std::string& why, absl::AnyInvocable<void()> done = nullptr);
  // Loop thread. The kubelet saw a container of `pod` restart (a FUSE server sidecar, perhaps).
  void ServerContainerRestarted(const PodRef& pod, const std::string& container);

  using Counts = VolumeCounts;
  Counts counts() const;

  // --- VolumeHost (for the kinds; loop thread) ---
  Loop& loop() override { return loop_; }
  const VolumeOpsContext& ops_context() const override { return ctx_; }
  const std::map<std::string, state::Volume>& volumes() const override { return volumes_; }
  const state::Volume* Find(const std::string& volume_id) const override;
  bool Busy(const std::string& volume_id) const override;
  ClaimQueue::Claim TryClaim(const std::string& volume_id) override;
  void RunClaimed(ClaimQueue::Claim claim, KindJob job, absl::AnyInvocable<void(absl::Status)> done) override;
  void Probe(const std::string& path, const std::string& mount_path, const PathMounts& mounts,
             StatsDone done) override;
  void Event(const state::Volume& v, const std::string& type, const std::string& reason,
             const std::string& message) override;
  bool AllPodsTerminating(const state::Volume& v) const override;
  void RefreshPods(absl::AnyInvocable<void()> done) override;
  void RecoveryFinished(const std::string& how, const std::string& outcome, absl::Duration latency) override;

 private:
  using Claim = ClaimQueue::Claim;
  // Runs `method(claim, req, done)` once the claim on (volume, target) is ours (ClaimQueue: a
  // claim on the whole volume when `target` is empty, else on that target of a staged volume):
  // at once if it is free, else when the volume's queue gets to it (`req` is then copied), or
  // answers `done` with the queue's refusal. The method ends the claim by dropping it, whatever
  // it answers: the queue moves on after every outcome.
  template <typename Req>
  void WithClaim(const std::string& volume_id, const std::string& target, const Req& req, Done done,
                 void (VolumeManager::*method)(Claim, const Req&, Done));
  void StageClaimed(Claim claim, const csi::v1::NodeStageVolumeRequest& req, Done done);
  void UnstageClaimed(Claim claim, const csi::v1::NodeUnstageVolumeRequest& req, Done done);
  void PublishClaimed(Claim claim, const csi::v1::NodePublishVolumeRequest& req, Done done);
  struct PublishPlan {
    VolumeKind* kind = nullptr;
    state::Spec spec;
    bool read_only = false;
  };
  absl::StatusOr<PublishPlan> PublishSpec(const csi::v1::NodePublishVolumeRequest& req, state::Volume* recorded) const;
  void UnpublishClaimed(Claim claim, const csi::v1::NodeUnpublishVolumeRequest& req, Done done);
  // Records what `from` (a job's copy of the volume) says of target `path` into the volume.
  void RecordTarget(const std::string& volume_id, const state::Volume& from, const std::string& path);
  // The kind named in volume_context (INVALID_ARGUMENT naming the supported ones if none is).
  absl::StatusOr<VolumeKind*> KindFor(const google::protobuf::Map<std::string, std::string>& volume_context) const;
  // The kind of a recorded volume (state saved before kinds existed: hostPath).
  VolumeKind& KindOf(const state::Volume& v) const;
  // The spec an RPC asks for: the kind's fields (parsed by the kind) and the capability's.
  absl::StatusOr<state::Spec> RequestSpec(VolumeKind& kind,
                                          const google::protobuf::Map<std::string, std::string>& volume_context,
                                          const csi::v1::VolumeCapability& cap, bool staged) const;
  // Runs `job` under `claim` and answers `done` with its outcome, from the pool thread (see
  // Stage). An error instead of a job ends the claim and is the answer.
  void RunRpcJob(Claim claim, absl::StatusOr<KindJob> job, Done done);
  // RunClaimed and RunRpcJob: `answer_from_pool` says where `done` runs. A job under a target
  // claim changes only that target of the recorded volume. The claim stays on the loop thread
  // (in running_claims_) while the job runs on the pool, and ends there after its outcome.
  void RunJob(Claim claim, KindJob job, absl::AnyInvocable<void(absl::Status)> done, bool answer_from_pool);
  // RunJob's first step when the job has a before-step.
  void RunBefore(Claim claim, KindJob job, absl::AnyInvocable<void(absl::Status)> done, bool answer_from_pool);
  // Records what a finished job says of the volume (of `target` only, when it worked on one).
  void RecordChange(const std::string& volume_id, const std::string& target, VolumeChange change);
  const state::Target* FindTargetOwner(const std::string& path, std::string* owner) const;
  // ALREADY_EXISTS if `path` is, contains or lies inside any path of any volume (other than the
  // same path of `volume_id` itself: a repeat). `field` names it in the message.
  absl::Status CheckPathFree(const std::string& path, const std::string& volume_id, const std::string& field) const;

  Loop& loop_;
  BlockingPool& pool_;
  const KubeletDir& kubelet_;
  const StateStore& store_;
  MountTableReader& table_reader_;
  const VolumeManagerOptions options_;
  VolumeOpsContext ctx_;
  std::atomic<bool> ready_{false};  // written on the loop; read anywhere (Probe)
  std::map<std::string, state::Volume> volumes_;
  std::map<std::string, std::unique_ptr<VolumeKind>> kinds_;  // by volume_context["kind"]
  // The claims of jobs on the pool, by job number; loop thread only. Declared before the queue,
  // which is destroyed first: claims that outlive it end without granting anyone.
  std::map<uint64_t, Claim> running_claims_;
  uint64_t next_job_ = 0;
  ClaimQueue claims_;
  std::set<std::string> terminating_pods_;
  std::function<void(std::function<void()>)> pod_refresher_;
  Timer audit_retry_;  // an audit that skipped busy volumes looks again soon
  std::unique_ptr<BlockingPool> own_probe_pool_;
  BlockingPool* probe_pool_;
  // One statfs of a mount and everyone waiting for its answer.
  struct ProbeRace {
    explicit ProbeRace(Loop& loop) : timer(loop) {}
    std::vector<StatsDone> dones;
    bool answered = false;  // by the result or the deadline
    Timer timer;  // the deadline (its callback holds the race weakly)
    StatsResult result = absl::UnknownError("not run");
    void Answer(const StatsResult& r);
  };
  // Mount paths with a statfs still outstanding (possibly hung): never more than one each.
  std::map<std::string, std::shared_ptr<ProbeRace>> probes_outstanding_;
  RecoveryHooks hooks_;
};

template <typename Req>
void VolumeManager::WithClaim(const std::string& volume_id, const std::string& target, const Req& req, Done done,
                              void (VolumeManager::*method)(Claim, const Req&, Done)) {
  if (!ready_) return done(absl::UnavailableError("fusekeeper is still reconciling volume state; retry"));
  if (Claim now = claims_.TryAcquire(volume_id, target)) return (this->*method)(std::move(now), req, std::move(done));
  auto answer = std::make_shared<Done>(std::move(done));  // by whichever comes: the turn or the refusal
  claims_.Acquire(
      volume_id, target,
      [this, req, method, answer](Claim claim) { (this->*method)(std::move(claim), req, std::move(*answer)); },
      [answer](absl::Status refused) { (*answer)(std::move(refused)); });
}

}  // namespace fusekeeper
