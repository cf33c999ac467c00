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

#include <map>
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

struct VolumeManagerOptions {
  // NodeGetVolumeStats answers `abnormal` if statfs has not returned by then.
  absl::Duration stats_timeout = absl::Seconds(5);
  // See VolumeOpsContext::ephemeral_host_path_prefixes.
  std::vector<std::string> ephemeral_host_path_prefixes;
  // Where staged FUSE volumes' handoff sockets live (a node-level server connects there).
  std::string socket_dir = "/var/lib/fusekeeper/sockets";
  // A FUSE volume no server has claimed by then is aborted, unmounted and forgotten.
  absl::Duration handoff_timeout = absl::Minutes(5);
  // How long a connected server has to answer the handoff.
  absl::Duration handoff_reply_timeout = absl::Seconds(10);
  // Threads for file-system probes (statfs), which can hang on an unresponsive FUSE server; kept
  // apart from the mount work's pool so that mount RPCs never wait behind them. The pool grows
  // when every probe thread is stuck (at most one probe per mount is outstanding, so a hung
  // volume costs one parked thread), up to max_probe_threads.
  int probe_threads = 2;
  int max_probe_threads = 1024;
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

 private:
  // Marks volume_id busy for the duration; ABORTED if it already is, UNAVAILABLE before Start.
  absl::Status Claim(const std::string& volume_id);
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
  void StartEndpoint(const state::Volume& v, const std::string& path, UniqueFd fuse_fd,
                     UniqueFd listen_fd, const std::map<std::string, std::string>& secrets,
                     const std::vector<std::string>& mount_options);
  void StopEndpoint(const std::string& volume_id, const std::string& path);
  void OnHandoffTimeout(const std::string& volume_id, const std::string& path);
  void StageFuse(const csi::v1::NodeStageVolumeRequest& req, state::Volume v,
                 std::optional<state::Volume> previous, Done done);
  void PublishFuseInline(const csi::v1::NodePublishVolumeRequest& req, state::Volume v, int index,
                         std::optional<state::Volume> previous, Done done);
  const state::Target* FindTargetOwner(const std::string& path, std::string* owner) const;

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
  struct Endpoint {
    std::shared_ptr<HandoffEndpoint> endpoint;
    TimerId timeout = 0;
    std::string gone_reason;  // why its server stopped serving, once it has
  };
  std::map<std::string, Endpoint> endpoints_;
  std::unique_ptr<BlockingPool> own_probe_pool_;
  BlockingPool* probe_pool_;
  // Mount paths with a statfs still outstanding (possibly hung): never more than one each.
  std::unordered_set<std::string> probes_outstanding_;
};

}  // namespace fusekeeper
