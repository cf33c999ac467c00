// The Pod the agent creates for a staged volume's FUSE server (server_spec.h), as JSON for the
// API server. Pure; any thread.
//
// One pod per volume per node: its name is derived from the volume id, the node and the server
// spec ("fk-<volume>-<node>-<spec>", hashes), so an agent that restarts finds the pod it made
// instead of making another, and a changed spec is a new pod beside the old one (a roll). Labels
// make every server pod of a node listable:
//   app.kubernetes.io/managed-by=fusekeeper, fusekeeper.io/node=<hash>, fusekeeper.io/volume=<hash>,
//   fusekeeper.io/server-spec=<hash>
// and annotations name the volume and node in full.
//
// The pod is bound to its node (spec.nodeName), unprivileged (non-root user, no capabilities,
// no privilege escalation, read-only root file system, RuntimeDefault seccomp, no service
// account token, no host paths), and reaches the agent through an emptyDir, kHandoffVolume,
// mounted at kHandoffDir: the agent finds it through the kubelet dir
// (<kubelet>/pods/<uid>/volumes/kubernetes.io~empty-dir/<kHandoffVolume>) and listens there.
#pragma once

#include <map>
#include <string>

#include "proto/state.pb.h"

namespace fusekeeper {

inline constexpr char kHandoffVolume[] = "fusekeeper-handoff";
inline constexpr char kHandoffDir[] = "/run/fusekeeper";
inline constexpr char kHandoffSocketName[] = "handoff.sock";
inline constexpr char kServerContainer[] = "server";
inline constexpr char kManagedByLabel[] = "app.kubernetes.io/managed-by";
inline constexpr char kManagedBy[] = "fusekeeper";
inline constexpr char kNodeLabel[] = "fusekeeper.io/node";
inline constexpr char kVolumeLabel[] = "fusekeeper.io/volume";
inline constexpr char kSpecLabel[] = "fusekeeper.io/server-spec";
inline constexpr char kVolumeAnnotation[] = "fusekeeper.io/volume-id";
inline constexpr char kNodeAnnotation[] = "fusekeeper.io/node-name";

// The agent's side of every server pod it makes (flags).
struct ServerPodSettings {
  std::string namespace_ = "fusekeeper";
  std::string node;
  std::string priority_class;  // empty: none
  std::map<std::string, std::string> default_requests = {{"cpu", "10m"}, {"memory", "32Mi"}};
  int termination_grace_seconds = 30;
  // Not in the manifest: how long a server pod's server, asked to stop, serves on while its
  // successor starts (MountConfig::drain_ms); below the grace period. 0: it stops at once.
  int64_t drain_ms = 25000;
  // The pod's seccomp profile: "RuntimeDefault", "Unconfined" or "Localhost/<profile path>".
  // containerd 2.0's RuntimeDefault refuses io_uring, which `fkserve launch` relays on.
  std::string seccomp_profile = "RuntimeDefault";
};

// Whether `profile` is a seccomp_profile above; empty: it is, else why not.
std::string SeccompProfileProblem(const std::string& profile);

struct ServerPodManifest {
  std::string name;
  std::string spec_hash;  // the fusekeeper.io/server-spec label
  std::string json;
};

// The label values for a volume and a node.
std::string VolumeLabelValue(const std::string& volume_id);
std::string NodeLabelValue(const std::string& node);
// The selector that lists a node's server pods.
std::string NodeSelector(const ServerPodSettings& settings);

// `successor`: the same pod under a second name (kSuccessorSuffix), made while the first is
// still terminating so that a server waits to take over the moment the old one stops.
inline constexpr char kSuccessorSuffix[] = "-2";
ServerPodManifest BuildServerPod(const ServerPodSettings& settings, const std::string& volume_id,
                                 const state::ServerPod& server, uint32_t uid, uint32_t gid, bool successor = false);

}  // namespace fusekeeper
