// ServerPods: the server pods of this node's staged volumes, kept as the volumes want them
// through the API server (pod_manifest.h for what a pod is). Loop thread only; HTTP goes through
// the ring (HttpClient), nothing blocks, and an unreachable API server only delays changes:
// volumes already served keep being served.
//
//  - Create: the pod a volume declares, before NodeStage mounts it (an error fails the RPC and
//    nothing is left behind). An existing pod of the same name is the same spec: found, not made
//    again (an agent restart, a retried NodeStage).
//  - Want / Release: which volumes want which server. A periodic resync lists the node's server
//    pods (label selector) and makes the API server agree: a wanted pod that is missing (deleted)
//    is created again; one that failed (evicted, its node's kubelet gave up on it) is deleted and
//    then created again; a pod no staged volume wants (an unstage while the API server was
//    unreachable, a crash) is deleted, but only after Start(), once every staged volume is known.
//  - Roll: a volume that now wants another spec gets the new pod beside the old one; the old one
//    is deleted once `standby_ready` says the new pod's server waits to take over (or, without
//    that hook, once the new pod runs). What starts a roll: the annotation kServerImageAnnotation
//    on the volume's PersistentVolume (read at each resync from the API server's cache), which
//    names another image for its server; removing it rolls back to the image the volume declares.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/kube/event_recorder.h"
#include "agent/kube/api_client.h"
#include "agent/kube/http_client.h"
#include "agent/kube/token_file.h"
#include "agent/loop/blocking_pool.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"
#include "agent/serverpod/api_objects.h"
#include "agent/serverpod/pod_manifest.h"

namespace fusekeeper {

struct ServerPodsOptions {
  ServerPodSettings settings;
  std::string driver_name = "fusekeeper.csi";  // whose PVs are ours
  absl::Duration resync = absl::Seconds(10);
  absl::Duration request_timeout = absl::Seconds(10);
};

class ServerPods {
 public:
  struct Events {
    // A pod of the volume exists with this uid (created, found after a restart, created again):
    // its handoff emptyDir appears under the kubelet dir once the kubelet starts it.
    absl::AnyInvocable<void(const std::string& volume_id, const std::string& pod_name, const std::string& pod_uid)>
        on_pod;
    // That pod is gone or going (deleted, evicted, failed, rolled away).
    absl::AnyInvocable<void(const std::string& volume_id, const std::string& pod_name, const std::string& pod_uid)>
        on_pod_gone;
    // Something to show on the volume's pods (type, reason, message).
    absl::AnyInvocable<void(const std::string& volume_id, const std::string& type, const std::string& reason,
                            const std::string& message)>
        on_event;
    // Whether the volume's new pod (uid) has a server waiting to take over from the old one.
    absl::AnyInvocable<bool(const std::string& volume_id, const std::string& pod_uid)> standby_ready;
  };
  struct Stats {
    int64_t created = 0, deleted = 0, recreated = 0, rolled = 0, api_errors = 0;
  };
  // All must outlive this object.
  ServerPods(Loop& loop, HttpClient& http, BlockingPool& pool, KubeApiConfig api, ServerPodsOptions options,
             Events events);
  ~ServerPods();
  // Loop thread, before anything happens: who hears of the pods (the fuse kind).
  void SetEvents(Events events) { events_ = std::move(events); }

  // Creates (or finds) the volume's pod for `spec` and wants it from then on. `done`: OK once
  // the API server has it; UNAVAILABLE when it cannot be reached or fails; FAILED_PRECONDITION
  // when it refuses (RBAC, a quota); INVALID_ARGUMENT when it rejects the pod. On an error the
  // volume is not wanted.
  void Create(const std::string& volume_id, const state::ServerPod& spec, uint32_t uid, uint32_t gid,
              absl::AnyInvocable<void(absl::Status)> done);
  // The volume wants this server (an agent restart re-learning its staged volumes; a roll).
  void Want(const std::string& volume_id, const state::ServerPod& spec, uint32_t uid, uint32_t gid);
  // The volume wants no server any more: its pods are deleted (now, and by later resyncs if the
  // API server cannot be reached now).
  void Release(const std::string& volume_id);
  // Starts the periodic resync (leftovers are deleted from now on).
  void Start();
  // A resync as soon as possible (a server went away: its pod may be gone).
  void ResyncSoon();

  // The pod the volume wants on this node: its name, and its uid once known.
  struct Wanted {
    std::string volume_id;
    state::ServerPod declared;  // as the volume declares it
    state::ServerPod spec;      // what runs: declared, with the PV's image annotation applied
    uint32_t uid = 0, gid = 0;
    ServerPodManifest manifest;
    // The same pod under its second name: made while `manifest`'s pod is still terminating (a
    // kubectl delete, an eviction), so that its server waits to take over as soon as the old one
    // stops, instead of only once the old pod object is gone. Whichever of the two lives serves.
    ServerPodManifest successor;
    // Every pod of the volume known to exist, by name → uid: the wanted one and, during a roll,
    // the one it replaces. on_pod has been said of each, on_pod_gone not yet.
    std::map<std::string, std::string> pods;
    bool created_once = false;  // a pod of this name existed: missing now means deleted
    std::string refused_image;  // an annotation's image found wrong (said once)
  };
  const std::map<std::string, Wanted>& wanted() const { return wanted_; }
  // The uids of the volume's pods known to exist (on_pod said, on_pod_gone not yet).
  std::vector<std::string> PodUids(const std::string& volume_id) const;
  bool HasPod(const std::string& volume_id, const std::string& pod_uid) const;
  const Stats& stats() const { return stats_; }
  const ServerPodSettings& settings() const { return options_.settings; }

 private:
  void Send(std::string method, std::string path, std::string body,
            absl::AnyInvocable<void(absl::StatusOr<HttpResult>)> done);
  // Creates `m` (the volume's manifest or its successor).
  void Post(const std::string& volume_id, const ServerPodManifest& m, absl::AnyInvocable<void(absl::Status)> done);
  // Whether `name` is one of the two names of the pod `w` wants.
  static bool Names(const Wanted& w, const std::string& name) {
    return name == w.manifest.name || name == w.successor.name;
  }
  void Delete(const std::string& name, const std::string& volume_id, const std::string& why);
  void Resync();
  void ListPods();
  // The PVs' image annotations: a wanted volume whose effective image changes rolls.
  void ApplyOverrides(const std::vector<ListedVolume>& volumes);
  // Sets what runs for `w` (a new manifest: a roll at the next reconcile).
  void SetSpec(Wanted& w, const state::ServerPod& spec);
  // `listed_at`: the list's number (lists_ when it was asked for).
  void Reconcile(const std::vector<ListedServerPod>& pods, uint64_t listed_at);
  void ScheduleResync(absl::Duration after);
  // Says on_pod of a pod of `w` not known yet.
  void Known(Wanted& w, const std::string& name, const std::string& uid);
  // Says on_pod_gone of a known pod of `w`.
  void Gone(Wanted& w, std::string name);

  Loop& loop_;
  const ServerPodsOptions options_;
  Events events_;
  ApiClient api_;
  std::map<std::string, Wanted> wanted_;  // by volume id
  // Pods seen in the last listing, by name (to tell a pod that went away).
  std::map<std::string, ListedServerPod> seen_;
  std::set<std::string> deleting_;  // names with a DELETE in flight
  std::set<std::string> creating_;  // names with a POST in flight
  bool started_ = false;
  bool resyncing_ = false;
  bool resync_again_ = false;
  bool pv_list_refused_ = false;  // said once
  uint64_t lists_ = 0;  // pod lists asked for
  // By pod name: lists_ when the pod became known (a list asked for before cannot show it).
  std::map<std::string, uint64_t> known_at_;
  Timer resync_timer_;
  Stats stats_;
};

}  // namespace fusekeeper
