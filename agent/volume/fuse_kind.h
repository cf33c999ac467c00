// The fuse volume kind (volume_context: kind=fuse, serverUid, serverGid, subtype, passSecrets;
// inline volumes also socketVolume, the pod's emptyDir shared with the sidecar server, and
// socketName). The agent mounts /dev/fuse itself (fuse_volume_ops.h) and hands the fd to the
// server over a HandoffEndpoint; staged volumes are one global mount that every target follows
// (mount_stack.h).
//
// Recovery (fuse_kind_recovery.cc) is this kind's too. Detection feeds in from the handoff
// endpoints (a server's connection closed, a server asked for a fresh connection, the kept
// connection was aborted), from the mount table (Audit) and from the kubelet (a FUSE server
// container restarted). Repairs run under the volume's claim, so they never race an RPC on the
// same volume, and are reported as Events and through the host only after a check through the
// repaired mount has succeeded.
//
// Loop thread only, like every VolumeKind.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include "agent/fuse/answer_probe.h"
#include "agent/fuse/handoff_endpoint.h"
#include "agent/serverpod/server_pods.h"
#include "agent/loop/timer.h"
#include "agent/volume/fuse_endpoints.h"
#include "agent/volume/fuse_volume_ops.h"
#include "agent/volume/repair_scheduler.h"
#include "agent/volume/volume_kind.h"

namespace fusekeeper {

inline constexpr char kFuseKind[] = "fuse";

// Validates a fuse volume's volume_context and capability (mount flags, volume_mount_group) and
// fills spec's fuse field and, with every key the agent does not read itself, its volume_context
// (handed to the server). Pure; any thread.
absl::Status ParseFuseSpec(const google::protobuf::Map<std::string, std::string>& volume_context,
                           const csi::v1::VolumeCapability& cap, state::Spec* spec);

struct FuseKindOptions {
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
  // A failed repair is retried after this, doubling up to max_repair_backoff.
  absl::Duration repair_backoff = absl::Milliseconds(200);
  absl::Duration max_repair_backoff = absl::Seconds(30);
  // A server that took a fresh connection (its ok reply) and has not answered the kernel's first
  // requests (FUSE_INIT, then a GETATTR of the mount's root: an AnswerProbe) within this long has
  // the connection aborted (the mount fails fast, ENOTCONN, instead of hanging every access) and
  // a Warning FuseServerNotAnswering posted; the next server gets a fresh connection. Zero: no
  // deadline (no probe).
  absl::Duration init_timeout = absl::Seconds(30);
  // Staged volumes that declare their server (volume_context serverImage) get a server pod on
  // this node through this (agent/serverpod); null: no API server, and such volumes are refused.
  ServerPods* server_pods = nullptr;
  // How often a server pod's handoff emptyDir is looked for until the kubelet has made it (for
  // 10 s; then doubling up to the max).
  absl::Duration pod_dir_retry = absl::Milliseconds(50);
  absl::Duration max_pod_dir_retry = absl::Seconds(5);
};

class FuseKind final : public VolumeKind {
 public:
  FuseKind(VolumeHost& host, FuseKindOptions options);

  absl::string_view name() const override { return kFuseKind; }
  absl::Status ParseSpec(const google::protobuf::Map<std::string, std::string>& volume_context,
                         const csi::v1::VolumeCapability& cap, bool staged, state::Spec* spec) const override;
  void ApplySpec(const state::Spec& spec, state::Volume* v) const override;
  absl::StatusOr<KindJob> Stage(StageCall call) override;
  absl::Status CheckPublish(const csi::v1::NodePublishVolumeRequest& req, const state::Volume* staged,
                            const state::Spec& spec, bool* read_only) const override;
  absl::StatusOr<KindJob> Publish(PublishCall call) override;
  KindJob Unpublish(const state::Volume& v, const state::Target& t) override;
  KindJob Unstage(const state::Volume& v) override;
  void Stats(const state::Volume& v, const std::string& path, const std::string& mount_path,
             const PathMounts& mounts, StatsDone done) override;

  // Recovery (fuse_kind_recovery.cc).
  void StartingBlocking() override;
  void Started() override;
  bool Audit(const MountTable& table, const state::Volume& v, const std::string& why) override;
  void ContainerRestarted(const state::Volume& v, const std::string& pod_uid, const std::string& container) override;
  void Count(const state::Volume& v, VolumeCounts* counts) const override;
  void CountKind(VolumeCounts* counts) const override;

 private:
  // The job that mounts a fresh FUSE connection for `v` at its staging path (target_index < 0)
  // or at a target, then starts its endpoint.
  KindJob MountJob(std::string reason, state::Volume v, int target_index, std::optional<state::Volume> previous,
                   bool socket_in_kubelet_dir, std::map<std::string, std::string> secrets,
                   std::vector<std::string> server_options);
  // `unclaimed_timeout`: a fresh volume no server claims within handoff_timeout is given up on
  // (volumes an earlier agent or a repair mounted keep waiting).
  void StartEndpoint(const state::Volume& v, const std::string& path, UniqueFd fuse_fd, HandoffSocket socket,
                     const std::map<std::string, std::string>& secrets,
                     const std::vector<std::string>& mount_options, bool unclaimed_timeout = true);
  // What the endpoint of the mount at `path` tells this kind.
  HandoffEndpoint::Events HandoffEvents(const std::string& volume_id, const std::string& path);
  void StopEndpoint(const std::string& volume_id, const std::string& path);
  void OnHandoffTimeout(const std::string& volume_id, const std::string& path);
  // A server took a fresh connection (`server`: who, for messages): ask whether it answers, and
  // abort the connection if it has not within options_.init_timeout (OnInitTimeout).
  void StartAnswerProbe(FuseEndpoint& e, const std::string& volume_id, const std::string& path, std::string server);
  void OnInitTimeout(const std::string& volume_id, const std::string& path);
  // The volume's FUSE tuning (fuse_tuning.h), written to the connection of its endpoint `serial`
  // once its server has answered; a failure is a Warning FuseTuningFailed.
  void Tune(const std::string& volume_id, const std::string& path, uint64_t serial);
  // Loop thread. Either timeout's end: the mount stays, its connection is aborted (so everything
  // waiting on it fails fast with ENOTCONN), a Warning `reason` says `message`, and the next
  // server that connects gets a fresh connection.
  void GiveUpOnConnection(FuseEndpoint& e, const state::Volume& v, const std::string& path, ClaimQueue::Claim claim,
                          const char* reason, const std::string& message, const char* job);
  void OnServerGone(const std::string& volume_id, const std::string& path, const absl::Status& why);
  // After the grace (and a fresh pod list): a server gone and not back, from a pod that is not
  // going away, is a Warning. Endpoint `serial` only (a later one is another story).
  void ServerGoneSettled(const std::string& volume_id, const std::string& path, const std::string& message,
                         uint64_t serial);
  void OnServed(const std::string& volume_id, const std::string& path, bool adopted);
  // Gives the volume a fresh connection and re-binds its targets.
  void RepairFuse(const std::string& volume_id, const std::string& why);
  // Re-binds the targets of a staged volume (adopting `adopt_global` as its global mount).
  void Rebind(const std::string& volume_id, const std::string& why, std::optional<state::MountIdentity> adopt_global);
  // Checks every mount of the volume through the FUSE server (statfs, under the stats deadline)
  // and reports MountRecovered / MountRecoveryFailed.
  void Verify(const std::string& volume_id, const std::string& how, absl::Time since);
  // Events for what a re-bind removed (stacked mounts) and could not do (failed targets).
  void ReportRebind(const RebindOutcome& r);

  // Server pods (ServerPods' events): a pod of the volume exists (its uid), or has gone.
  void OnServerPod(const std::string& volume_id, const std::string& pod_name, const std::string& pod_uid);
  void OnServerPodGone(const std::string& volume_id, const std::string& pod_name, const std::string& pod_uid);
  // Listens in the pod's handoff emptyDir once the kubelet has made it, as one more listener of
  // the volume's endpoint (retried, backing off, while the pod exists and the directory does not).
  void AttachPodListener(const std::string& volume_id, const std::string& pod_uid, absl::Duration retry);
  // An inline volume's handoff socket is under a mount made on its directory after it (the
  // kubelet mounts a Memory emptyDir's tmpfs on a directory it made first, and sets up a pod's
  // volumes in parallel): the sidecar sees an empty directory and waits for ever.
  bool SocketHidden(const MountTable& table, const state::Volume& v) const;
  // Makes the socket again where the server looks, as the endpoint's listener; false if the
  // volume is busy (the audit comes back).
  bool MakeSocketAgain(const state::Volume& v);
  // Whether a server from that pod serves the volume or waits to (a roll may retire the old pod).
  bool ServerWaitsFrom(const std::string& volume_id, const std::string& pod_uid) const;

  const FuseKindOptions options_;
  FuseEndpoints endpoints_;
  BackingBroker broker_;  // passthrough for the volumes' servers (backing_broker.h)
  RepairScheduler repairs_;
  // One-shot waits of their own: server-gone graces, a server pod's directory looked for again.
  Timers later_;
  std::map<std::string, absl::Duration> pod_dir_waited_;  // by pod uid: how long its emptyDir was looked for
  // Volumes whose handoff socket a restarted agent is making again (Started): they have no
  // endpoint yet, and are awaiting a re-deposit as far as anyone asking can tell.
  std::set<std::string> restoring_;
  std::set<std::string> remaking_socket_;  // volumes whose hidden socket is being made again
  int64_t servers_not_answering_ = 0;  // connections aborted because their server did not answer
  int64_t tunings_applied_ = 0, tunings_failed_ = 0;
};

}  // namespace fusekeeper
