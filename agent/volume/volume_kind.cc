#include "agent/volume/volume_kind.h"

#include "absl/strings/str_cat.h"

namespace fusekeeper {

KindJob StateJob(std::string reason, absl::AnyInvocable<absl::StatusOr<std::optional<state::Volume>>()> work) {
  return KindJob{std::move(reason), [work = std::move(work)]() mutable -> absl::StatusOr<AdoptFn> {
                   auto r = work();
                   if (!r.ok()) return r.status();
                   return AdoptFn([v = std::move(*r)]() mutable {
                     return v.has_value() ? VolumeChange::Set(std::move(*v)) : VolumeChange::Erase();
                   });
                 }};
}

void VolumeKind::Stats(const state::Volume&, const std::string& path, const std::string& mount_path,
                       const PathMounts& mounts, StatsDone done) {
  host_.Probe(path, mount_path, mounts, std::move(done));
}

void VolumeKind::Count(const state::Volume&, VolumeCounts* counts) const {
  ++counts->volumes_by_kind_state[absl::StrCat(name(), "/mounted")];
}

}  // namespace fusekeeper
