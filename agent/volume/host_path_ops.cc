#include "agent/volume/host_path_ops.h"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include "absl/strings/str_cat.h"
#include "agent/base/crash_point.h"
#include "agent/base/status.h"
#include "agent/paths/host_path.h"
#include "glog/logging.h"

namespace fusekeeper {

bool EphemeralHostPathAllowed(const VolumeOpsContext& ctx, const std::string& path) {
  for (const std::string& prefix : ctx.ephemeral_host_path_prefixes) {
    if (IsAtOrBelow(path, prefix)) return true;
  }
  return false;
}

absl::StatusOr<state::Volume> StageHostPathBlocking(const VolumeOpsContext& ctx, state::Volume v,
                                                    std::optional<state::Volume> previous, const BindOptions& bind) {
  auto type = ParseHostPathType(v.host_path_type());
  if (!type.ok()) return type.status();
  auto source = OpenHostPathBlocking(v.host_path(), *type, /*untrusted=*/false, ctx.host_root);
  if (!source.ok()) return source.status();
  struct stat st;
  if (fstat(source->fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat", v.host_path());
  v.set_is_directory(source->is_directory);
  v.set_source_dev_major(major(st.st_dev));
  v.set_source_dev_minor(minor(st.st_dev));
  v.set_staging_pending(true);
  // Intent first: a kill -9 after the bind but before the save below leaves a mount that the
  // start-up reconcile attributes (by the source's device) only because this entry names it.
  if (auto s = ctx.store->SaveBlocking(v); !s.ok()) return s;
  CrashPoint("stage-intent-saved");

  auto fail = [&](absl::Status s) {
    RollBack(ctx, v.volume_id(), previous);
    return s;
  };
  auto rel = Rel(ctx, v.staging_path());
  if (!rel.ok()) return fail(rel.status());
  if (auto made = EnsureMountPointBlocking(ctx, *rel, /*directory=*/true); !made.ok()) return fail(made.status());
  std::string mount_rel = *rel;
  if (!v.is_directory()) {
    mount_rel = absl::StrCat(*rel, "/", kStagedFileName);
    if (auto made = EnsureMountPointBlocking(ctx, mount_rel, false); !made.ok()) return fail(made.status());
  }
  const std::string mount_path = Abs(ctx, mount_rel);
  auto target = ctx.kubelet->OpenPathBlocking(mount_rel);
  if (!target.ok()) return fail(target.status());
  auto facts = LookupMountAtBlocking(target->get(), mount_path);
  if (!facts.ok()) return fail(facts.status());
  if (SameDevice(*facts, v.source_dev_major(), v.source_dev_minor())) {
    LOG(INFO) << "volume " << v.volume_id() << ": " << mount_path << " is already mounted; adopting it";
  } else {
    if (auto s = BindMountFdBlocking(source->fd.get(), target->get(), bind, v.host_path(), mount_path); !s.ok()) {
      return fail(s);
    }
    CrashPoint("stage-mounted");
  }
  auto mounted = ctx.kubelet->OpenPathBlocking(mount_rel);
  if (!mounted.ok()) return fail(mounted.status());
  auto id = IdentifyBlocking(mounted->get(), mount_path);
  if (!id.ok()) return fail(id.status());
  *v.mutable_staging_mount() = *id;
  v.set_staging_pending(false);
  // Done: the mount's identity, which tells our mount from anything stacked or swapped later.
  if (auto s = ctx.store->SaveBlocking(v); !s.ok()) return s;
  return v;
}

absl::StatusOr<PublishSource> OpenEphemeralHostPathBlocking(const VolumeOpsContext& ctx, state::Volume* volume) {
  state::Volume& v = *volume;
  auto type = ParseHostPathType(v.host_path_type());
  if (!type.ok()) return type.status();
  auto opened = OpenHostPathBlocking(v.host_path(), *type, /*untrusted=*/true, ctx.host_root);
  if (!opened.ok()) return opened.status();
  // The check that matters is on what was opened: symlinks cannot lead it elsewhere.
  auto real = RealPathOfFd(opened->fd.get());
  if (!real.ok()) return real.status();
  // As the node names it: the agent sees the node's root at host_root.
  if (!ctx.host_root.empty() && IsAtOrBelow(*real, ctx.host_root)) {
    *real = real->size() == ctx.host_root.size() ? "/" : real->substr(ctx.host_root.size());
  }
  if (!EphemeralHostPathAllowed(ctx, *real)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "hostPath ", v.host_path(), " resolves to ", *real,
        ", which is not below --ephemeral_host_path_prefixes"));
  }
  struct stat st;
  if (fstat(opened->fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat", v.host_path());
  v.set_is_directory(opened->is_directory);
  v.set_source_dev_major(major(st.st_dev));
  v.set_source_dev_minor(minor(st.st_dev));
  return PublishSource{std::move(opened->fd), v.host_path()};
}

}  // namespace fusekeeper
