// The host-path kind's own blocking halves (BlockingPool only): staging a host path, and opening
// an unstaged (ephemeral inline) volume's host path to publish it. What both kinds share
// (publishing from a staging mount, unpublishing, unstaging, stats) is volume_ops.h.
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "agent/mount/mount_ops.h"
#include "agent/volume/volume_ops.h"
#include "proto/state.pb.h"

namespace fusekeeper {

// Whether an unstaged host-path volume may come from `path` (see ephemeral_host_path_prefixes).
bool EphemeralHostPathAllowed(const VolumeOpsContext& ctx, const std::string& path);

// Stages `volume` (host_path, host_path_type and staging_path set) at its staging path.
// `previous`: what was saved of this volume before (restored on failure).
absl::StatusOr<state::Volume> StageHostPathBlocking(const VolumeOpsContext& ctx, state::Volume volume,
                                                    std::optional<state::Volume> previous, const BindOptions& bind);

// An unstaged volume's host path, opened without letting symlinks lead it elsewhere and checked
// to resolve below --ephemeral_host_path_prefixes; records in `volume` what it is (directory,
// device).
absl::StatusOr<PublishSource> OpenEphemeralHostPathBlocking(const VolumeOpsContext& ctx, state::Volume* volume);

}  // namespace fusekeeper
