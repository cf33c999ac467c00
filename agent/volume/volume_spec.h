// Pieces of volume_context and capability validation that more than one volume kind uses. Pure
// functions, any thread. Errors are INVALID_ARGUMENT naming the field; mount flags are named by
// position only, since they may carry secrets.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "agent/mount/mount_ops.h"
#include "google/protobuf/map.h"
#include "proto/csi.pb.h"
#include "proto/state.pb.h"

namespace fusekeeper {

// Keys kubelet adds to volume_context (CSIDriver podInfoOnMount).
inline constexpr char kPodUidKey[] = "csi.storage.k8s.io/pod.uid";
inline constexpr char kPodNameKey[] = "csi.storage.k8s.io/pod.name";
inline constexpr char kPodNamespaceKey[] = "csi.storage.k8s.io/pod.namespace";

// volume_context[key], or "" if absent.
std::string ContextValue(const google::protobuf::Map<std::string, std::string>& ctx, const char* key);

// A decimal uid/gid (at most 2^32-1). `what` names the field in the error.
absl::StatusOr<uint32_t> ParseId(const std::string& value, absl::string_view what);

// A single path component chosen by a pod author: not empty, ".", ".." and without '/' or NUL.
absl::Status CheckName(const std::string& name, absl::string_view what);

// Whether a mount must be read-only for the request itself: `readonly`, or a reader-only access mode.
bool ReadOnlyRequested(const csi::v1::VolumeCapability& cap, bool readonly);

// The mount flags a bind mount honours (ro, rw, bind, defaults, nosuid, nodev, noexec); read-only
// also when `readonly` or the access mode is a reader-only one. `kind` names the volume kind in
// the error for any other flag.
absl::StatusOr<BindOptions> ParseBindOptions(const csi::v1::VolumeCapability& cap, bool readonly,
                                             absl::string_view kind);

// The fingerprint of what a request asks for: `spec` (the kind and its fields) plus the
// capability's fields, readonly and the staging path. Equal fingerprints are repeats of one
// request; different ones for the same volume or path are conflicts. The bytes hashed must stay
// what earlier agents saved, since saved state is compared after an upgrade.
std::string RequestFingerprint(state::Spec spec, const csi::v1::VolumeCapability& cap, bool readonly,
                               const std::string& staging_path);

// What staged volume `v` was staged with (kind `kind`), as a publish of it is fingerprinted.
state::Spec StagedSpec(const state::Volume& v, const std::string& kind);

}  // namespace fusekeeper
