// What the agent reads of the API server's answers about server pods: a PodList, a Pod, a
// PersistentVolumeList. Pure; any thread. Fuzzed (tests/fuzz/server_pods_fuzz.cc).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fusekeeper {

// One item of a PodList, as far as the agent reads it.
struct ListedServerPod {
  std::string name, uid, phase;
  std::string volume_id;     // kVolumeAnnotation
  std::string volume_label;  // kVolumeLabel: what tells the volume's pods
  std::string spec_hash;  // kSpecLabel
  std::string node;          // kNodeAnnotation
  std::string image;         // the server container's
  bool ready = false;        // the server container's status says ready
  bool terminating = false;  // deletionTimestamp set
};
absl::StatusOr<std::vector<ListedServerPod>> ParseServerPodList(absl::string_view json);
// The uid of a pod object (a POST's or GET's answer).
absl::StatusOr<std::string> ParsePodUid(absl::string_view json);

// On a PersistentVolume: the image its server pods run instead of the declared serverImage.
inline constexpr char kServerImageAnnotation[] = "fusekeeper.io/server-image";

// On a PersistentVolume beside kServerImageAnnotation: the share of nodes that take it ("25%",
// ParseRolloutPercent); the others keep the declared image. Absent: every node.
inline constexpr char kServerRolloutAnnotation[] = "fusekeeper.io/server-image-rollout";

// One PersistentVolume of ours, as far as rolls go.
struct ListedVolume {
  std::string volume_handle;
  std::string server_image;  // kServerImageAnnotation; empty: none
  std::string rollout;       // kServerRolloutAnnotation; empty: none
};
// The PVs of `driver` in a PersistentVolumeList.
absl::StatusOr<std::vector<ListedVolume>> ParseVolumeList(absl::string_view json, const std::string& driver);

// The "message" of an API Status body, shortened; empty if there is none.
std::string ApiMessage(const std::string& body);

}  // namespace fusekeeper
