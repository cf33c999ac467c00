// The FUSE server a staged volume declares in its volume_context, for the agent to run as a pod
// on each node that stages the volume (server_pods.h):
//   serverImage      an image reference with a tag or a digest ("repo/fs:1.2", "repo/fs@sha256:…")
//   serverCommand    optional, a JSON array of strings: the container's command
//   serverArgs       optional, a JSON array of strings: its args; "{socket}" stands for the
//                    handoff socket's path inside the pod (also in $FUSEKEEPER_SOCKET)
//   serverResources  optional, JSON {"requests": {...}, "limits": {...}} of cpu, memory and
//                    ephemeral-storage quantities; requests the volume leaves out get the agent's
//                    defaults, so every server pod's requests are explicit
//   serverUid/Gid    required with serverImage, not 0: the pod runs as that user, non-root
// Pure; any thread.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/map.h"
#include "proto/state.pb.h"

namespace fusekeeper {

// The volume_context keys above (serverUid/Gid excepted: the fuse kind reads those).
bool IsServerPodKey(const std::string& key);

// Whether the volume_context declares a server pod (serverImage given, even empty).
bool DeclaresServerPod(const google::protobuf::Map<std::string, std::string>& volume_context);

// Validates the keys above into `pod`. `uid`/`gid`: the volume's serverUid/serverGid, which must
// have been given (`has_uid`) and not be 0. Errors are INVALID_ARGUMENT and name the key.
absl::Status ParseServerPod(const google::protobuf::Map<std::string, std::string>& volume_context, bool has_uid,
                            uint32_t uid, uint32_t gid, state::ServerPod* pod);

// An image reference with a tag (not "latest") or a sha256 digest. `what` names it in errors.
absl::Status CheckServerImage(const std::string& image, const std::string& what);

// A Kubernetes quantity without a sign ("50m", "64Mi", "1.5", "2G"). `what` names it in errors.
absl::Status CheckQuantity(const std::string& value, const std::string& what);

// The share of nodes that take a PersistentVolume's image annotation (a roll in batches):
// "25%" or "25", 0 to 100. `what` names it in errors (INVALID_ARGUMENT).
absl::StatusOr<int> ParseRolloutPercent(const std::string& value, const std::string& what);

// Where a node stands in a volume's rollout, 0 to 99: a node takes a rollout of N% when its
// bucket is below N. Derived from the volume and the node, so every agent agrees without asking
// any other, a node stays in the batch as N grows, and each volume starts on other nodes.
int RolloutBucket(const std::string& volume_id, const std::string& node);

}  // namespace fusekeeper
