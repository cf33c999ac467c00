#include "agent/volume/volume_ops.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "agent/base/crash_point.h"
#include "agent/base/status.h"
#include "agent/paths/host_path.h"
#include "agent/sys/syscalls.h"
#include "agent/volume/mount_stack.h"
#include "agent/volume/reconcile.h"
#include "glog/logging.h"

namespace fusekeeper {

std::string Abs(const VolumeOpsContext& ctx, const std::string& rel) {
  return absl::StrCat(ctx.kubelet->real_path(), "/", rel);
}

absl::StatusOr<std::string> Rel(const VolumeOpsContext& ctx, const std::string& path) {
  return ctx.kubelet->Relative(path, "path");
}

absl::StatusOr<state::MountIdentity> IdentifyBlocking(int fd, const std::string& path) {
  auto facts = LookupMountAtBlocking(fd, path);
  if (!facts.ok()) return facts.status();
  if (!facts->has_value()) {
    return absl::InternalError(absl::StrCat("nothing is mounted at ", path, " right after mounting it"));
  }
  state::MountIdentity id;
  id.set_dev_major((*facts)->dev_major);
  id.set_dev_minor((*facts)->dev_minor);
  id.set_root((*facts)->root);
  id.set_unique_id((*facts)->mnt_id);
  return id;
}

bool SameDevice(const std::optional<sys::MountFacts>& facts, uint32_t major, uint32_t minor) {
  return facts.has_value() && facts->dev_major == major && facts->dev_minor == minor;
}

namespace {

// A staged volume's targets follow the global mount (see mount_stack.h).
BindOptions StagedBind(const state::Volume& v, BindOptions bind) {
  bind.follow_source = !v.staging_path().empty();
  return bind;
}

// Saves what became of target `path` of `v`. A staged volume's targets are published and
// unpublished concurrently (each under its own claim; VolumeManager): each records only its own
// target. Other volumes are saved whole.
absl::Status SaveTarget(const VolumeOpsContext& ctx, const state::Volume& v, const std::string& path) {
  if (!v.staging_path().empty()) return ctx.store->SaveTargetBlocking(v, path);
  return ctx.store->SaveBlocking(v);
}

// Restores what was saved of target `path` before a failed publish began (for a staged volume:
// that target only; else the whole volume).
void RollBackTarget(const VolumeOpsContext& ctx, const state::Volume& v, const std::string& path,
                    const std::optional<state::Volume>& previous) {
  absl::Status s;
  if (!v.staging_path().empty() && previous) {
    s = ctx.store->SaveTargetBlocking(*previous, path);
  } else {
    s = previous ? ctx.store->SaveBlocking(*previous) : ctx.store->RemoveBlocking(v.volume_id());
  }
  if (!s.ok()) LOG(ERROR) << "rolling back state of volume " << v.volume_id() << " at " << path << ": " << s;
}

}  // namespace

void RollBack(const VolumeOpsContext& ctx, const std::string& volume_id,
              const std::optional<state::Volume>& previous) {
  absl::Status s = previous ? ctx.store->SaveBlocking(*previous) : ctx.store->RemoveBlocking(volume_id);
  if (!s.ok()) LOG(ERROR) << "rolling back state of volume " << volume_id << ": " << s;
}

absl::StatusOr<bool> EnsureMountPointBlocking(const VolumeOpsContext& ctx, const std::string& rel,
                                              bool directory) {
  auto parent = ctx.kubelet->OpenParentBlocking(rel);
  if (!parent.ok()) return parent.status();
  const std::string name(BaseName(rel));
  if (directory) {
    if (mkdirat(parent->get(), name.c_str(), 0750) == 0) return true;
    if (errno != EEXIST) return ErrnoStatus(errno, "mkdir", Abs(ctx, rel));
  } else {
    int fd = openat(parent->get(), name.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0640);
    if (fd >= 0) {
      close(fd);
      return true;
    }
    if (errno != EEXIST) return ErrnoStatus(errno, "creating", Abs(ctx, rel));
  }
  // The existing mount point may already be a FUSE mount (a repeated publish): never ask its server.
  mode_t type = 0;
  if (sys::StatxTypeNoSync(parent->get(), name.c_str(), &type) != 0) {
    return ErrnoStatus(errno, "stat", Abs(ctx, rel));
  }
  if (type == S_IFLNK) {
    return absl::InvalidArgumentError(
        absl::StrCat(Abs(ctx, rel), " is a symlink; refusing to mount onto it"));
  }
  if (directory != (type == S_IFDIR)) {
    return absl::FailedPreconditionError(absl::StrCat(
        Abs(ctx, rel), " exists and is ", type == S_IFDIR ? "a directory" : "not a directory",
        ", but the volume's source ", directory ? "is a directory" : "is not a directory"));
  }
  return false;
}

namespace {

// Removes a mount point we created (or any empty directory).
void RemoveMountPointBlocking(const VolumeOpsContext& ctx, const std::string& rel, bool directory,
                              bool created) {
  auto parent = ctx.kubelet->OpenParentBlocking(rel);
  if (!parent.ok()) return;
  const std::string name(BaseName(rel));
  // What is there now decides, not what the state says: a kill -9 can lose the record that we
  // created a file target. A CSI target path is ours to remove once unmounted (the CO creates
  // only its parent): an empty directory, or an empty regular file (a file mount point).
  struct statx stx{};
  if (statx(parent->get(), name.c_str(), AT_SYMLINK_NOFOLLOW | AT_STATX_DONT_SYNC, STATX_TYPE | STATX_SIZE, &stx) != 0) {
    return;  // already gone
  }
  const mode_t type = stx.stx_mode & S_IFMT;
  int r = 0;
  if (type == S_IFDIR) {
    r = unlinkat(parent->get(), name.c_str(), AT_REMOVEDIR);
  } else if (type == S_IFREG && (stx.stx_size == 0 || (created && !directory))) {
    r = unlinkat(parent->get(), name.c_str(), 0);
  } else {
    return;  // not a mount point of ours: left alone
  }
  if (r != 0 && errno != ENOENT) LOG(WARNING) << "could not remove " << Abs(ctx, rel) << ": " << strerror(errno);
}

}  // namespace

bool MountMatches(const std::optional<sys::MountFacts>& facts, const state::MountIdentity& id) {
  if (!facts.has_value()) return false;
  if (facts->dev_major != id.dev_major() || facts->dev_minor != id.dev_minor() ||
      facts->root != id.root()) {
    return false;
  }
  return id.unique_id() == 0 || facts->mnt_id == 0 || facts->mnt_id == id.unique_id();
}

absl::StatusOr<PublishSource> OpenStagingMountBlocking(const VolumeOpsContext& ctx, const state::Volume& v) {
  auto rel = Rel(ctx, v.staging_path());
  if (!rel.ok()) return rel.status();
  std::string mount_rel = v.is_directory() ? *rel : absl::StrCat(*rel, "/", kStagedFileName);
  PublishSource source{UniqueFd(), Abs(ctx, mount_rel)};
  auto fd = ctx.kubelet->OpenPathBlocking(mount_rel);
  if (!fd.ok()) return fd.status();
  auto facts = LookupMountAtBlocking(fd->get(), source.name);
  if (!facts.ok()) return facts.status();
  if (!MountMatches(*facts, v.staging_mount())) {
    return absl::FailedPreconditionError(absl::StrCat("volume ", v.volume_id(),
                                                      " is no longer mounted at its staging path ", source.name,
                                                      "; stage it again"));
  }
  source.fd = std::move(*fd);
  return source;
}

absl::StatusOr<state::Volume> PublishBlocking(const VolumeOpsContext& ctx, state::Volume v, int index,
                                              std::optional<state::Volume> previous, const BindOptions& bind,
                                              PublishSource source) {
  const std::string target_path = v.targets(index).path();
  auto fail = [&](absl::Status s) {
    RollBackTarget(ctx, v, target_path, previous);
    return s;
  };
  state::Target* t = v.mutable_targets(index);
  t->set_pending(true);
  // Intent first: a kill -9 after the bind but before the save below leaves a mount that the
  // start-up reconcile can only attribute (and remove or adopt) because this entry names it.
  if (auto s = SaveTarget(ctx, v, target_path); !s.ok()) return s;
  CrashPoint("publish-intent-saved");
  auto rel = Rel(ctx, t->path());
  if (!rel.ok()) return fail(rel.status());
  auto created = EnsureMountPointBlocking(ctx, *rel, v.is_directory());
  if (!created.ok()) return fail(created.status());
  if (*created) t->set_created(true);
  auto target = ctx.kubelet->OpenPathBlocking(*rel);
  if (!target.ok()) return fail(target.status());
  auto facts = LookupMountAtBlocking(target->get(), Abs(ctx, *rel));
  if (!facts.ok()) return fail(facts.status());
  // Adopted only if this volume already recorded this target (kubelet re-publishing after its
  // restart, or a retry after a crash the start-up reconcile resolved): a mount of the same file
  // system at a new target may be another volume's.
  bool recorded = false;
  if (previous) {
    for (const auto& pt : previous->targets()) recorded = recorded || pt.path() == t->path();
  }
  if (recorded && SameDevice(*facts, v.source_dev_major(), v.source_dev_minor())) {
    LOG(INFO) << "volume " << v.volume_id() << ": " << t->path() << " is already mounted; adopting it";
  } else if (facts->has_value()) {
    return fail(absl::AlreadyExistsError(absl::StrCat(
        "something else (", (*facts)->fs_type, ") is already mounted at ", t->path())));
  } else if (auto s = BindMountFdBlocking(source.fd.get(), target->get(), StagedBind(v, bind), source.name, t->path());
             !s.ok()) {
    if (*created) RemoveMountPointBlocking(ctx, *rel, v.is_directory(), true);
    return fail(s);
  } else {
    CrashPoint("publish-mounted");
  }
  auto mounted = ctx.kubelet->OpenPathBlocking(*rel);
  if (!mounted.ok()) return fail(mounted.status());
  auto id = IdentifyBlocking(mounted->get(), Abs(ctx, *rel));
  if (!id.ok()) return fail(id.status());
  *t->mutable_mount() = *id;
  t->set_pending(false);
  // Done: the mount's identity, which tells our mount from anything stacked or swapped later.
  if (auto s = SaveTarget(ctx, v, target_path); !s.ok()) return s;
  return v;
}

absl::StatusOr<std::optional<state::Volume>> UnpublishBlocking(const VolumeOpsContext& ctx,
                                                               state::Volume v,
                                                               const std::string& path) {
  int index = -1;
  for (int i = 0; i < v.targets_size(); ++i) {
    if (v.targets(i).path() == path) index = i;
  }
  if (index >= 0) {
    const state::Target& t = v.targets(index);
    auto rel = Rel(ctx, path);
    if (!rel.ok()) return rel.status();
    state::MountIdentity id = t.mount();
    state::MountIdentity base = TargetBase(t);
    if (t.pending()) {  // never completed: whatever of ours is there has the source's device
      id.set_dev_major(v.source_dev_major());
      id.set_dev_minor(v.source_dev_minor());
      base = id;
    }
    // Every layer: a repair may have stacked the live connection on the base publish made.
    absl::Status s = UnmountStackBlocking(*ctx.kubelet, path, id, base, v.kind() == "fuse");
    if (!s.ok() && !(t.pending() && s.code() == absl::StatusCode::kFailedPrecondition)) return s;
    CrashPoint("unpublish-unmounted");
    RemoveMountPointBlocking(ctx, *rel, v.is_directory(), t.created());
    v.mutable_targets()->DeleteSubrange(index, 1);
  }
  if (v.staging_path().empty() && v.targets_size() == 0) {
    if (auto s = ctx.store->RemoveBlocking(v.volume_id()); !s.ok()) return s;
    return std::optional<state::Volume>();
  }
  // After the unmount: a kill -9 before this save leaves an entry whose mount is gone, which
  // the start-up reconcile drops. (Saving first would forget a mount that is still there.)
  if (auto s = SaveTarget(ctx, v, path); !s.ok()) return s;
  return std::optional<state::Volume>(std::move(v));
}

absl::Status UnstageBlocking(const VolumeOpsContext& ctx, const state::Volume& v) {
  auto rel = Rel(ctx, v.staging_path());
  if (!rel.ok()) return rel.status();
  std::string mount_rel = v.is_directory() ? *rel : absl::StrCat(*rel, "/", kStagedFileName);
  state::MountIdentity id = v.staging_mount();
  state::MountIdentity base = StagingBase(v);
  if (v.staging_pending()) {
    id.set_dev_major(v.source_dev_major());
    id.set_dev_minor(v.source_dev_minor());
    base = id;
  }
  const std::string mount_path = v.is_directory() ? v.staging_path() : absl::StrCat(v.staging_path(), "/", kStagedFileName);
  absl::Status s = UnmountStackBlocking(*ctx.kubelet, mount_path, id, base, v.kind() == "fuse");
  if (!s.ok() && !(v.staging_pending() && s.code() == absl::StatusCode::kFailedPrecondition)) return s;
  CrashPoint("unstage-unmounted");
  if (!v.is_directory()) RemoveMountPointBlocking(ctx, mount_rel, false, true);
  return ctx.store->RemoveBlocking(v.volume_id());
}

absl::Status ForgetUnknownPathBlocking(const VolumeOpsContext& ctx, const std::string& path,
                                       const std::string& volume_id, bool remove_dir) {
  auto rel = Rel(ctx, path);
  if (!rel.ok()) return rel.status();
  auto fd = ctx.kubelet->OpenPathBlocking(*rel);
  if (!fd.ok()) return fd.status().code() == absl::StatusCode::kNotFound ? absl::OkStatus() : fd.status();
  auto facts = LookupMountAtBlocking(fd->get(), Abs(ctx, *rel));
  if (!facts.ok()) return facts.status();
  if (facts->has_value()) {
    return absl::NotFoundError(absl::StrCat("volume ", volume_id, " is not known to fusekeeper at ",
                                            path, ", and something else is mounted there"));
  }
  fd->Reset();
  if (remove_dir) RemoveMountPointBlocking(ctx, *rel, /*directory=*/true, false);
  return absl::OkStatus();
}

namespace {
// a * b, or INT64_MAX if that does not fit (CSI's usage fields are int64).
int64_t SaturatingProduct(uint64_t a, uint64_t b) {
  unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return p > static_cast<unsigned __int128>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(p);
}
int64_t Clamped(uint64_t v) { return v > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(v); }
}  // namespace

StatfsUsage UsageOf(const struct statfs& sf) {
  const uint64_t unit = static_cast<uint64_t>(sf.f_frsize ? sf.f_frsize : sf.f_bsize);
  const uint64_t blocks = sf.f_blocks, bfree = sf.f_bfree, bavail = sf.f_bavail;
  const uint64_t files = sf.f_files, ffree = sf.f_ffree;
  StatfsUsage u;
  u.total_bytes = SaturatingProduct(blocks, unit);
  u.available_bytes = SaturatingProduct(bavail, unit);
  u.used_bytes = SaturatingProduct(blocks >= bfree ? blocks - bfree : 0, unit);
  u.total_inodes = Clamped(files);
  u.available_inodes = Clamped(ffree);
  u.used_inodes = Clamped(files >= ffree ? files - ffree : 0);
  return u;
}

absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse> StatsBlocking(const VolumeOpsContext& ctx,
                                                                  const std::string& path,
                                                                  const PathMounts& mounts) {
  csi::v1::NodeGetVolumeStatsResponse resp;
  auto rel = Rel(ctx, path);
  if (!rel.ok()) return rel.status();
  auto fd = ctx.kubelet->OpenPathBlocking(*rel);
  if (!fd.ok()) {
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(std::string(fd.status().message()));
    return resp;
  }
  auto facts = LookupMountAtBlocking(fd->get(), Abs(ctx, *rel));
  if (!facts.ok()) return facts.status();
  if (!MountMatches(*facts, mounts.top)) {
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(
        facts->has_value() ? absl::StrCat(path, " has a different mount on it (", (*facts)->fs_type, ")")
                           : absl::StrCat(path, " is not mounted any more"));
    return resp;
  }
  if (!VisibleThroughBase(**facts, mounts.base)) {
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(absl::StrCat(
        path, " is served by a mount that is not on the one running containers follow: they do not see it"));
    return resp;
  }
  struct statfs sf;
  if (fstatfs(fd->get(), &sf) != 0) {
    resp.mutable_volume_condition()->set_abnormal(true);
    resp.mutable_volume_condition()->set_message(
        absl::StrCat("statfs ", path, " failed: ", strerror(errno)));
    return resp;
  }
  const StatfsUsage u = UsageOf(sf);
  auto* bytes = resp.add_usage();
  bytes->set_unit(csi::v1::VolumeUsage::BYTES);
  bytes->set_total(u.total_bytes);
  bytes->set_available(u.available_bytes);
  bytes->set_used(u.used_bytes);
  auto* inodes = resp.add_usage();
  inodes->set_unit(csi::v1::VolumeUsage::INODES);
  inodes->set_total(u.total_inodes);
  inodes->set_available(u.available_inodes);
  inodes->set_used(u.used_inodes);
  resp.mutable_volume_condition()->set_abnormal(false);
  resp.mutable_volume_condition()->set_message("mounted");
  return resp;
}

bool ReidentifyVolumeBlocking(const VolumeOpsContext& ctx, state::Volume* v) {
  bool changed = false;
  if (!v->staging_path().empty() && !v->staging_pending()) {
    changed |= ReidentifyBlocking(*ctx.kubelet, StagingMountPath(*v), v->mutable_staging_mount(),
                                  v->has_staging_base() ? v->mutable_staging_base() : nullptr);
  }
  for (auto& t : *v->mutable_targets()) {
    if (t.pending()) continue;
    changed |= ReidentifyBlocking(*ctx.kubelet, t.path(), t.mutable_mount(), t.has_base() ? t.mutable_base() : nullptr);
  }
  return changed;
}

}  // namespace fusekeeper
