// VolumeManager: the Node RPCs' logic, on the loop thread. It owns the in-memory volume state,
// serialises operations per volume (a second RPC for a volume with one in flight gets ABORTED;
// different volumes never wait on each other), decides idempotent repeats and conflicts from that
// state, and runs the blocking halves (agent/volume/volume_ops) on the BlockingPool.
//
// Volume kinds:
//  - `hostPath` (volume_context: kind=hostPath, path, type);
//  - `fuse` (volume_context: kind=fuse, serverUid, serverGid, subtype, passSecrets; inline volumes
//    also socketVolume (the pod's emptyDir shared with the sidecar server) and socketName). The
//    agent mounts /dev/fuse itself and hands the fd to the server over a HandoffEndpoint; an
//    unclaimed volume is torn down after handoff_timeout.
#pragma once

#include <deque>
#include <map>
#include <optional>
#include <set>
#include <memory>
#include <string>
#include <unordered_set>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/loop/blocking_pool.h"
#include "agent/fuse/handoff_endpoint.h"
#include "agent/loop/loop.h"
#include "agent/mount/table_reader.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/volume/state_store.h"
#include "agent/volume/fuse_volume_ops.h"
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
  // Where staged FUSE volumes' handoff sockets live (a node-level server connects there).
  std::string socket_dir = "/var/lib/fusekeeper/sockets";
  // A FUSE volume no server has claimed by then has its connection aborted (it stays mounted and
  // fails fast) and a Warning posted; a server that connects later gets a fresh connection.
  absl::Duration handoff_timeout = absl::Minutes(5);
  // How long a connected server has to answer the handoff.
  absl::Duration handoff_reply_timeout = absl::Seconds(10);
  // After an agent restart: how long a connecting server has to re-deposit the volume's live
  // connection before it is taken to want a fresh one (HandoffOptions::redeposit_wait).
  absl::Duration redeposit_wait = absl::Seconds(1);
  // A FUSE server that stops is reported (Warning FuseServerNotConnected) only if its volume is
  // not unpublished within this grace: kubelet stops a deleted pod's sidecar just before it
  // unpublishes, and that is no failure.
  absl::Duration server_gone_grace = absl::Seconds(2);
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
  // A failed repair is retried after this, doubling up to max_repair_backoff.
  absl::Duration repair_backoff = absl::Milliseconds(200);
  absl::Duration max_repair_backoff = absl::Seconds(30);
};

class VolumeManager {
 public:
  using Done = absl::AnyInvocable<void(absl::Status)>;
  using StatsDone = absl::AnyInvocable<void(absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse>)>;

  // All references must outlive the manager. `probe_pool` runs statfs probes; null: the manager
  // makes its own (options.probe_threads).
  VolumeManager(Loop& loop, BlockingPool& pool, const KubeletDir& kubelet, const StateStore& store,
                MountTableReader& table_reader, VolumeManagerOptions options = {},
                BlockingPool* probe_pool = nullptr);

  // Loop thread. Loads saved state, reconciles it with the mount table (read through the ring),
  // and writes back what changed. RPCs before `done` get UNAVAILABLE.
  void Start(Done done);
  bool ready() const { return ready_; }

  // Loop thread; `done` runs on the loop thread. Requests were validated (csi/validate).
  void Stage(const csi::v1::NodeStageVolumeRequest& req, Done done);
  void Unstage(const csi::v1::NodeUnstageVolumeRequest& req, Done done);
  void Publish(const csi::v1::NodePublishVolumeRequest& req, Done done);
  void Unpublish(const csi::v1::NodeUnpublishVolumeRequest& req, Done done);
  void Stats(const csi::v1::NodeGetVolumeStatsRequest& req, StatsDone done);

  size_t volume_count() const { return volumes_.size(); }
  // Loop thread. The pods the kubelet reports as terminating (deletionTimestamp set): a FUSE
  // server of theirs that stops is a pod going away, not a failure.
  void SetTerminatingPods(std::set<std::string> pod_uids) { terminating_pods_ = std::move(pod_uids); }
  // Loop thread. Pod uid → names of the volume directories published into that pod
  // (`…/pods/<uid>/volumes/kubernetes.io~csi/<name>/mount`), for every target that records its pod.
  std::map<std::string, std::set<std::string>> PublishedVolumeDirsByPod() const;

  // --- Recovery (volume_recovery.cc) ---
  void set_recovery_hooks(RecoveryHooks hooks) { hooks_ = std::move(hooks); }
  // Loop thread. Compares every volume's mounts with the mount table (read through the ring) and
  // repairs what is broken: a global mount that is gone (remount a fresh connection) or was
  // replaced by someone else (adopt it), pod targets not bound to the current global mount
  // (bind again). Volumes with an RPC in flight are skipped (the next audit sees them).
  // `why` names the trigger ("mount table changed", "periodic audit", "start-up").
  void Audit(const std::string& why, absl::AnyInvocable<void()> done = nullptr);
  // Loop thread. The kubelet saw the container of a volume's FUSE server restart.
  void ServerContainerRestarted(const PodRef& pod, const std::string& container);

  struct Counts {
    std::map<std::string, int> volumes_by_kind_state;  // "fuse/serving", "hostPath/mounted", ...
    int handoffs_waiting = 0;
    int repairs_in_progress = 0;
  };
  Counts counts() const;

 private:
  // Marks volume_id busy for the duration; ABORTED if it already is, UNAVAILABLE before Start.
  absl::Status Claim(const std::string& volume_id);
  // Ends a claim; the next RPC waiting for the volume runs.
  void Release(const std::string& volume_id);
  // If volume_id is busy, queues `method(req, done)` to run when it is free and returns true
  // (`done` is then owned by the queue: answered by the method, or with an error if the wait is
  // too long or the queue full). False: not busy, go ahead.
  template <typename Req>
  bool WaitTurn(const std::string& volume_id, const Req& req, Done& done,
                void (VolumeManager::*method)(const Req&, Done));
  // Runs `work` on the pool; then, on the loop, releases the claim and passes its result to
  // `adopt` (which stores state, starts endpoints...) and adopt's status to done.
  template <typename T>
  void RunJob(const std::string& volume_id, std::string reason, absl::AnyInvocable<absl::StatusOr<T>()> work,
              absl::AnyInvocable<absl::Status(T)> adopt, Done done);
  // RunJob whose result is the volume's new state (nullopt: the volume is gone).
  void RunVolumeJob(const std::string& volume_id, std::string reason,
                    absl::AnyInvocable<absl::StatusOr<std::optional<state::Volume>>()> work, Done done);
  // FUSE: endpoints by volume and mount path.
  static std::string EndpointKey(const std::string& volume_id, const std::string& path);
  // `unclaimed_timeout`: a fresh volume no server claims within handoff_timeout is torn down
  // (volumes an earlier agent or a repair mounted keep waiting).
  void StartEndpoint(const state::Volume& v, const std::string& path, UniqueFd fuse_fd,
                     UniqueFd listen_fd, const std::map<std::string, std::string>& secrets,
                     const std::vector<std::string>& mount_options, bool unclaimed_timeout = true);
  void StopEndpoint(const std::string& volume_id, const std::string& path);
  // After start-up: handoff sockets for FUSE volumes mounted by an earlier agent.
  void ListenAgain();
  void OnHandoffTimeout(const std::string& volume_id, const std::string& path);
  void StageFuse(const csi::v1::NodeStageVolumeRequest& req, state::Volume v,
                 std::optional<state::Volume> previous, Done done);
  void PublishFuseInline(const csi::v1::NodePublishVolumeRequest& req, state::Volume v, int index,
                         std::optional<state::Volume> previous, Done done);
  const state::Target* FindTargetOwner(const std::string& path, std::string* owner) const;
  // ALREADY_EXISTS if `path` is, contains or lies inside any path of any volume (other than the
  // same path of `volume_id` itself: a repeat). `field` names it in the message.
  absl::Status CheckPathFree(const std::string& path, const std::string& volume_id, const std::string& field) const;
  // statfs of the mount at mount_path (which must be `id`) on the probe pool, answered within
  // the stats deadline: abnormal if it is unresponsive (`path` names it in messages).
  void Probe(const std::string& path, const std::string& mount_path, const state::MountIdentity& id,
             StatsDone done);
  // Recovery (volume_recovery.cc).
  void OnServerGone(const std::string& volume_id, const std::string& path, const absl::Status& why);
  void OnServed(const std::string& volume_id, const std::string& path, bool adopted);
  void RepairFuse(const std::string& volume_id, const std::string& why);
  void Rebind(const std::string& volume_id, const std::string& why, std::optional<state::MountIdentity> adopt_global);
  // Checks every mount of the volume through the FUSE server (statfs, under the stats deadline)
  // and reports MountRecovered / MountRecoveryFailed.
  void Verify(const std::string& volume_id, const std::string& how, absl::Time since);
  // Every pod the volume is published to is terminating (and there is at least one).
  bool AllPodsTerminating(const state::Volume& v) const;
  void EventForVolume(const state::Volume& v, const std::string& type, const std::string& reason,
                      const std::string& message);
  void RetryLater(const std::string& volume_id, absl::AnyInvocable<void()> fn);
  // Events for what a re-bind removed (stacked mounts) and could not do (failed targets).
  void ReportRebind(const RebindOutcome& r);

  Loop& loop_;
  BlockingPool& pool_;
  const KubeletDir& kubelet_;
  const StateStore& store_;
  MountTableReader& table_reader_;
  const VolumeManagerOptions options_;
  VolumeOpsContext ctx_;
  bool ready_ = false;
  std::map<std::string, state::Volume> volumes_;
  std::unordered_set<std::string> busy_;
  struct Waiter {
    absl::AnyInvocable<void(Done)> run;
    Done done;
    TimerId timer = 0;
  };
  std::map<std::string, std::deque<std::shared_ptr<Waiter>>> waiters_;  // per busy volume, FIFO
  struct Endpoint {
    std::shared_ptr<HandoffEndpoint> endpoint;
    TimerId timeout = 0;
    uint64_t serial = 0;     // tells this endpoint from a later one for the same path
    bool gave_up = false;    // no server came within handoff_timeout: the connection was aborted
    int gone_pending = 0;    // server-gone Warnings waiting out server_gone_grace
    std::string gone_reason;  // why its server stopped serving, once it has
    int adoptions_seen = 0;
    absl::Time recovering_since = absl::InfinitePast();  // a recovery awaits a serving server
    std::string recovering_how;
  };
  std::map<std::string, Endpoint> endpoints_;
  uint64_t endpoint_serial_ = 0;
  std::set<std::string> terminating_pods_;
  bool audit_retry_pending_ = false;  // an audit that skipped busy volumes looks again soon
  std::unique_ptr<BlockingPool> own_probe_pool_;
  BlockingPool* probe_pool_;
  // One statfs of a mount and everyone waiting for its answer.
  struct ProbeRace {
    std::vector<StatsDone> dones;
    bool answered = false;  // by the result or the deadline
    TimerId timer = 0;
    absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse> result = absl::UnknownError("not run");
    void Answer(const absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse>& r);
  };
  // Mount paths with a statfs still outstanding (possibly hung): never more than one each.
  std::map<std::string, std::shared_ptr<ProbeRace>> probes_outstanding_;
  RecoveryHooks hooks_;
  std::unordered_set<std::string> repairing_;           // volumes with a repair queued or running
  std::map<std::string, absl::Duration> backoff_;       // per volume, after failed repairs
};

template <typename T>
void VolumeManager::RunJob(const std::string& volume_id, std::string reason,
                           absl::AnyInvocable<absl::StatusOr<T>()> work,
                           absl::AnyInvocable<absl::Status(T)> adopt, Done done) {
  struct Job {
    absl::AnyInvocable<absl::StatusOr<T>()> work;
    absl::StatusOr<T> result = absl::UnknownError("not run");
    absl::AnyInvocable<absl::Status(T)> adopt;
    Done done;
  };
  auto job = std::make_shared<Job>();
  job->work = std::move(work);
  job->adopt = std::move(adopt);
  job->done = std::move(done);
  absl::Status s = pool_.Submit(
      std::move(reason), [job] { job->result = job->work(); },
      [this, volume_id, job](absl::Status ran) {
        Release(volume_id);
        if (!ran.ok()) return job->done(ran);
        if (!job->result.ok()) return job->done(job->result.status());
        job->done(job->adopt(std::move(*job->result)));
      });
  if (!s.ok()) {
    Release(volume_id);
    job->done(s);
  }
}

template <typename Req>
bool VolumeManager::WaitTurn(const std::string& volume_id, const Req& req, Done& done,
                             void (VolumeManager::*method)(const Req&, Done)) {
  if (!ready_ || busy_.count(volume_id) == 0) return false;
  auto& queue = waiters_[volume_id];
  if (static_cast<int>(queue.size()) >= options_.max_queued_per_volume) {
    done(absl::ResourceExhaustedError(absl::StrCat(queue.size(), " RPCs already wait for volume ", volume_id,
                                                   "; retry later")));
    return true;
  }
  auto w = std::make_shared<Waiter>();
  w->run = [this, req, method](Done d) { (this->*method)(req, std::move(d)); };
  w->done = std::move(done);
  const absl::Time since = absl::Now();
  w->timer = loop_.AddTimer(absl::ToChronoNanoseconds(options_.max_queue_wait), [this, volume_id, w, since] {
    auto it = waiters_.find(volume_id);
    if (it == waiters_.end()) return;
    auto& q = it->second;
    for (auto i = q.begin(); i != q.end(); ++i) {
      if (*i != w) continue;
      q.erase(i);
      if (q.empty()) waiters_.erase(it);
      w->done(absl::AbortedError(absl::StrCat("waited ", absl::FormatDuration(absl::Now() - since),
                                              " for an operation on volume ", volume_id,
                                              " (an RPC or a repair) that has not finished; retry")));
      return;
    }
  });
  queue.push_back(std::move(w));
  return true;
}

}  // namespace fusekeeper
