#include "agent/volume/fuse_volume_ops.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "agent/base/crash_point.h"
#include "agent/base/status.h"
#include "agent/fuse/fuse_mount.h"
#include "agent/fuse/handoff_endpoint.h"
#include "agent/mount/mount_ops.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/sys/syscalls.h"
#include "agent/volume/mount_stack.h"
#include "agent/volume/volume_spec.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

std::string Dir(const std::string& path) { return path.substr(0, path.rfind('/')); }
std::string Name(const std::string& path) { return path.substr(path.rfind('/') + 1); }

// Opens a directory beneath the kubelet dir that will hold a handoff socket (a pod's emptyDir),
// without following symlinks; it must belong to root or the server's uid. NOT_FOUND if absent.
absl::StatusOr<UniqueFd> OpenKubeletSocketDirBlocking(const VolumeOpsContext& ctx, const std::string& dir,
                                                      uint32_t server_uid) {
  auto rel = ctx.kubelet->Relative(dir, "socket directory");
  if (!rel.ok()) return rel.status();
  auto fd = ctx.kubelet->OpenPathBlocking(*rel);
  if (!fd.ok()) return fd.status();
  struct statx stx{};
  if (statx(fd->get(), "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW, STATX_TYPE | STATX_UID, &stx) != 0) {
    return ErrnoStatus(errno, "statx", dir);
  }
  if ((stx.stx_mode & S_IFMT) != S_IFDIR) {
    return absl::FailedPreconditionError(absl::StrCat(dir, " is not a directory"));
  }
  if (stx.stx_uid != 0 && stx.stx_uid != server_uid) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the socket directory ", dir, " belongs to uid ", stx.stx_uid, ", neither root nor the "
        "server's uid ", server_uid));
  }
  return std::move(*fd);
}

// The socket `name` made listening in `dir_fd`, with that directory's device.
absl::StatusOr<HandoffSocket> ListenIn(int dir_fd, const std::string& name, const state::Volume& v) {
  struct stat st;
  if (fstat(dir_fd, &st) != 0) return ErrnoStatus(errno, "stat", Dir(v.fuse().socket_path()));
  auto listen = HandoffEndpoint::ListenBlocking(dir_fd, name, v.fuse().server_uid(), v.fuse().server_gid());
  if (!listen.ok()) return listen.status();
  return HandoffSocket{std::move(*listen), major(st.st_dev), minor(st.st_dev)};
}

// Opens the directory that will hold the handoff socket.
absl::StatusOr<UniqueFd> OpenSocketDirBlocking(const VolumeOpsContext& ctx, const state::Volume& v,
                                               bool in_kubelet_dir) {
  const std::string dir = Dir(v.fuse().socket_path());
  if (!in_kubelet_dir) {
    if (mkdir(dir.c_str(), 0711) != 0 && errno != EEXIST) return ErrnoStatus(errno, "mkdir", dir);
    int fd = open(dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, "open", dir);
    return UniqueFd(fd);
  }
  auto fd = OpenKubeletSocketDirBlocking(ctx, dir, v.fuse().server_uid());
  if (!fd.ok() && fd.status().code() == absl::StatusCode::kNotFound) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the socket directory ", dir, " does not exist: is the emptyDir named in volume_context "
        "socketVolume mounted in the pod?"));
  }
  return fd;
}

FuseMountOptions MountOptionsFor(const state::Volume& v, bool read_only_target) {
  FuseMountOptions mo;
  mo.subtype = v.fuse().subtype().empty() ? "fusekeeper" : v.fuse().subtype();
  mo.source = v.volume_id();
  mo.user_id = v.fuse().server_uid();
  mo.group_id = v.fuse().server_gid();
  mo.read_only = v.fuse().read_only() || read_only_target;
  mo.noexec = v.fuse().noexec();
  mo.noatime = v.fuse().noatime();
  mo.max_read = v.fuse().max_read();
  return mo;
}

// The FUSE mount at the staging path (target_index < 0) or at a target is being made.
void MarkPending(state::Volume& v, int target_index) {
  if (target_index < 0) return v.set_staging_pending(true);
  v.mutable_targets(target_index)->set_pending(true);
}

// ... and was made: `id`, in a directory we `created` or not.
void RecordMounted(state::Volume& v, int target_index, const state::MountIdentity& id, bool created) {
  if (target_index < 0) {
    *v.mutable_staging_mount() = id;
    v.set_staging_pending(false);
    return;
  }
  state::Target* t = v.mutable_targets(target_index);
  *t->mutable_mount() = id;
  t->set_created(created);
  t->set_pending(false);
}

}  // namespace

std::string FuseMountPath(const state::Volume& v) {
  if (!v.staging_path().empty()) return v.staging_path();
  return v.targets_size() == 1 ? v.targets(0).path() : "";
}

absl::StatusOr<FuseMounted> MountFuseVolumeBlocking(const VolumeOpsContext& ctx, state::Volume v,
                                                    int target_index, std::optional<state::Volume> previous,
                                                    bool socket_in_kubelet_dir) {
  const bool staging = target_index < 0;
  const std::string path = staging ? v.staging_path() : v.targets(target_index).path();
  MarkPending(v, target_index);
  v.set_is_directory(true);
  // Intent first: a kill -9 after the FUSE mount but before the save below leaves a mount the
  // start-up reconcile recognises (by subtype and source) only because this entry announces it.
  if (auto s = ctx.store->SaveBlocking(v); !s.ok()) return s;
  auto fail = [&](absl::Status s) {
    RollBack(ctx, v.volume_id(), previous);
    return s;
  };

  auto socket_dir = OpenSocketDirBlocking(ctx, v, socket_in_kubelet_dir);
  if (!socket_dir.ok()) return fail(socket_dir.status());
  auto rel = ctx.kubelet->Relative(path, staging ? "staging_target_path" : "target_path");
  if (!rel.ok()) return fail(rel.status());
  auto parent = ctx.kubelet->OpenParentBlocking(*rel);
  if (!parent.ok()) return fail(parent.status());
  const std::string name(BaseName(*rel));
  bool created = false;
  if (mkdirat(parent->get(), name.c_str(), 0750) == 0) {
    created = true;
  } else if (errno != EEXIST) {
    return fail(ErrnoStatus(errno, "mkdir", path));
  }
  auto target = ctx.kubelet->OpenPathBlocking(*rel);
  if (!target.ok()) return fail(target.status());
  const std::string table_path = ctx.kubelet->MountTablePath(path);
  auto existing = LookupMountAtBlocking(target->get(), table_path);
  if (!existing.ok()) return fail(existing.status());
  if (existing->has_value()) {
    return fail(absl::AlreadyExistsError(absl::StrCat(
        "something (", (*existing)->fs_type, ") is already mounted at ", path)));
  }
  auto dev = OpenFuseDeviceBlocking();
  if (!dev.ok()) return fail(dev.status());
  const FuseMountOptions mo = MountOptionsFor(v, !staging && v.targets(target_index).readonly());
  if (auto s = MountFuseBlocking(dev->get(), target->get(), path, mo); !s.ok()) {
    if (created) unlinkat(parent->get(), name.c_str(), AT_REMOVEDIR);
    return fail(s);
  }
  CrashPoint(staging ? "fuse-stage-mounted" : "fuse-publish-mounted");
  auto mounted = ctx.kubelet->OpenPathBlocking(*rel);
  if (!mounted.ok()) return fail(mounted.status());
  auto facts = LookupMountAtBlocking(mounted->get(), table_path);
  if (!facts.ok()) return fail(facts.status());
  if (!facts->has_value()) return fail(absl::InternalError(absl::StrCat("FUSE mount at ", path, " vanished")));
  const state::MountIdentity id = IdentityOf(**facts);
  v.set_source_dev_major(id.dev_major());
  v.set_source_dev_minor(id.dev_minor());
  auto listen = ListenIn(socket_dir->get(), Name(v.fuse().socket_path()), v);
  if (!listen.ok()) {
    mounted->Reset();
    AbortFuseConnectionBlocking(id.dev_minor());
    UnmountAtBlocking(parent->get(), name, table_path);
    if (created) unlinkat(parent->get(), name.c_str(), AT_REMOVEDIR);
    return fail(listen.status());
  }
  RecordMounted(v, target_index, id, created);
  // Done: the mount's identity, which tells it from a later repair's layer or a foreign mount.
  if (auto s = ctx.store->SaveBlocking(v); !s.ok()) return s;
  return FuseMounted{std::move(v), std::move(*dev), std::move(*listen)};
}

absl::Status TearDownFuseMountBlocking(const VolumeOpsContext& ctx, const std::string& path,
                                       const state::MountIdentity& id, const state::MountIdentity& base,
                                       const state::Volume& v, bool socket_in_kubelet_dir) {
  // The socket first, so no server can connect to a volume that is going away. Unlinked through
  // its directory, never following a symlink.
  if (!v.fuse().socket_path().empty()) {
    auto dir = OpenSocketDirBlocking(ctx, v, socket_in_kubelet_dir);
    // With any temporary name of it an agent killed while making it left.
    if (dir.ok()) HandoffEndpoint::RemoveSocketBlocking(dir->get(), Name(v.fuse().socket_path()));
  }
  // Abort next: a dead or hung server then cannot keep the unmount (or anyone) waiting.
  AbortConnectionsAtBlocking(*ctx.kubelet, path, {id.dev_minor(), base.dev_minor()});
  // Every layer: the live one a repair stacked and the base under it.
  absl::Status s = UnmountStackBlocking(*ctx.kubelet, path, id, base, /*fuse_layers=*/true);
  if (!s.ok() && s.code() != absl::StatusCode::kFailedPrecondition) return s;
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> ListenInServerPodBlocking(const VolumeOpsContext& ctx, const state::Volume& v,
                                                   const std::string& pod_uid, const std::string& empty_dir,
                                                   const std::string& socket_name) {
  if (auto s = CheckName(pod_uid, "server pod uid"); !s.ok()) return s;
  const std::string dir = absl::StrCat(ctx.kubelet->path(), "/pods/", pod_uid, "/volumes/kubernetes.io~empty-dir/",
                                       empty_dir);
  auto fd = OpenKubeletSocketDirBlocking(ctx, dir, v.fuse().server_uid());
  if (!fd.ok()) return fd.status();
  return HandoffEndpoint::ListenBlocking(fd->get(), socket_name, v.fuse().server_uid(), v.fuse().server_gid());
}

absl::StatusOr<HandoffSocket> ListenForServerBlocking(const VolumeOpsContext& ctx, const state::Volume& v) {
  const bool in_kubelet_dir = v.staging_path().empty();
  auto dir = OpenSocketDirBlocking(ctx, v, in_kubelet_dir);
  if (!dir.ok()) return dir.status();
  return ListenIn(dir->get(), Name(v.fuse().socket_path()), v);
}

absl::StatusOr<FuseRemounted> RemountFuseBlocking(const VolumeOpsContext& ctx, state::Volume v) {
  const bool staging = !v.staging_path().empty();
  if (!staging && v.targets_size() != 1) {
    return absl::FailedPreconditionError(absl::StrCat("volume ", v.volume_id(), " has no single FUSE mount to replace"));
  }
  const std::string path = staging ? v.staging_path() : v.targets(0).path();
  const state::MountIdentity old = staging ? v.staging_mount() : v.targets(0).mount();
  state::MountIdentity base = staging ? StagingBase(v) : TargetBase(v.targets(0));
  auto rel = ctx.kubelet->Relative(path, "path");
  if (!rel.ok()) return rel.status();
  FuseRemounted out;
  // Our old connections first: aborted, so that nothing (no pod, no thread of ours) keeps waiting
  // on them. The base stays mounted: running containers hold copies of it.
  AbortConnectionsAtBlocking(*ctx.kubelet, path, {old.dev_minor(), base.dev_minor()});
  // Dead layers above the base go (their umount propagates into the containers' copies too).
  auto stripped = StripToBaseBlocking(*ctx.kubelet, path, base, std::nullopt);
  if (!stripped.ok()) return stripped.status();
  out.removed = stripped->removed;
  const bool on_base = stripped->at_base;
  // The base as it is now, in this mount namespace (the record may be another namespace's).
  if (on_base) base = IdentityOf(*stripped->top);
  auto target = ctx.kubelet->OpenPathBlocking(*rel);
  if (!target.ok()) return target.status();
  auto dev = OpenFuseDeviceBlocking();
  if (!dev.ok()) return dev.status();
  const FuseMountOptions mo = MountOptionsFor(v, !staging && v.targets(0).readonly());
  if (auto s = MountFuseBlocking(dev->get(), target->get(), path, mo); !s.ok()) return s;
  target->Reset();
  CrashPoint("recovery-fresh-mounted");
  auto top = TopOfBlocking(*ctx.kubelet, path);
  if (!top.ok()) return top.status();
  if (!top->has_value()) return absl::InternalError(absl::StrCat("fresh FUSE mount at ", path, " vanished"));
  if (!on_base) {
    // Nothing was left at the path (someone unmounted the base): the fresh mount is the new base,
    // and only containers started from now on can see it.
    LOG(WARNING) << "volume " << v.volume_id() << ": the mount at " << path
                 << " was gone; the fresh connection is its new base";
    base = IdentityOf(**top);
  } else if (!VisibleThroughBase(**top, base)) {
    return absl::InternalError(absl::StrCat("the fresh FUSE mount at ", path, " is not on the mount containers follow"));
  }
  if (staging) {
    *v.mutable_staging_mount() = IdentityOf(**top);
    *v.mutable_staging_base() = base;
  } else {
    *v.mutable_targets(0)->mutable_mount() = IdentityOf(**top);
    *v.mutable_targets(0)->mutable_base() = base;
  }
  v.set_source_dev_major((*top)->dev_major);
  v.set_source_dev_minor((*top)->dev_minor);
  if (auto s = ctx.store->SaveBlocking(v); !s.ok()) return s;
  out.volume = std::move(v);
  out.fuse_fd = std::move(*dev);
  return out;
}

namespace {

// One target of RebindTargetsBlocking: returns whether its record changed (in `t`).
bool RebindTargetBlocking(const VolumeOpsContext& ctx, const std::string& staging_rel, const state::Volume& v,
                          state::Target* t, RebindOutcome& o) {
  const state::MountIdentity& global = v.staging_mount();
  if (t->pending()) return false;
  auto rel = ctx.kubelet->Relative(t->path(), "target_path");
  if (!rel.ok()) {
    o.failed.push_back(absl::StrCat(t->path(), ": ", rel.status().message()));
    return false;
  }
  if (!ctx.kubelet->OpenParentBlocking(*rel).ok()) {
    // The pod's volume directory is gone (the pod is being deleted): not ours to touch.
    o.skipped.push_back(t->path());
    return false;
  }
  state::MountIdentity base = TargetBase(*t);
  auto stripped = StripToBaseBlocking(*ctx.kubelet, t->path(), base, global);
  if (!stripped.ok()) {
    o.failed.push_back(absl::StrCat(t->path(), ": ", stripped.status().message()));
    return false;
  }
  if (stripped->removed > 1) o.stacked_removed += stripped->removed - 1;
  // The base as it is now, in this mount namespace (the record may be another namespace's).
  if (stripped->at_base) base = IdentityOf(*stripped->top);
  std::optional<sys::MountFacts> top = std::move(stripped->top);
  if (!stripped->live) {
    // Stack a bind of the live global mount on the base (or, if the target lost every mount,
    // make it the new base).
    auto source = ctx.kubelet->OpenPathBlocking(staging_rel);
    auto target = ctx.kubelet->OpenPathBlocking(*rel);
    if (!source.ok() || !target.ok()) {
      o.failed.push_back(absl::StrCat(t->path(), ": ", (!source.ok() ? source.status() : target.status()).message()));
      return false;
    }
    BindOptions bind;
    bind.read_only = t->readonly();
    bind.follow_source = true;
    if (auto s = BindMountFdBlocking(source->get(), target->get(), bind, v.staging_path(), t->path()); !s.ok()) {
      o.failed.push_back(absl::StrCat(t->path(), ": ", s.message()));
      return false;
    }
    target->Reset();
    auto now = TopOfBlocking(*ctx.kubelet, t->path());
    if (!now.ok() || !now->has_value()) {
      o.failed.push_back(absl::StrCat(t->path(), ": the new bind mount vanished"));
      return false;
    }
    if (!stripped->at_base) base = IdentityOf(**now);
    top = std::move(*now);
  } else if (IsMount(*top, t->mount())) {
    return false;  // healthy: already on the live connection
  }
  // Else the live layer arrived by propagation from the global mount.
  if (!VisibleThroughBase(*top, base)) {
    o.failed.push_back(absl::StrCat(t->path(), ": the live connection is not on the mount its containers follow"));
    return false;
  }
  *t->mutable_mount() = IdentityOf(*top);
  *t->mutable_base() = base;
  o.rebound.push_back(t->path());
  CrashPoint("recovery-rebound-one");
  return true;
}

}  // namespace

absl::StatusOr<RebindOutcome> RebindTargetsBlocking(const VolumeOpsContext& ctx, state::Volume v) {
  RebindOutcome out;
  if (v.staging_path().empty() || v.staging_pending()) {
    out.volume = std::move(v);
    return out;
  }
  auto staging_rel = ctx.kubelet->Relative(v.staging_path(), "staging_target_path");
  if (!staging_rel.ok()) return staging_rel.status();
  bool changed = false;
  // Each target is independent, and most of the time goes to waiting in umount (RCU grace
  // periods), so several are repaired at once.
  const int n = v.targets_size();
  const int workers = std::min(8, std::max(1, n / 8));
  std::vector<RebindOutcome> partial(static_cast<size_t>(workers));
  std::vector<char> changed_by(static_cast<size_t>(workers), 0);
  std::atomic<int> next{0};
  auto work = [&](int w) {
    bool c = false;
    for (int i = next++; i < n; i = next++) {
      c = RebindTargetBlocking(ctx, *staging_rel, v, v.mutable_targets(i), partial[static_cast<size_t>(w)]) || c;
    }
    changed_by[static_cast<size_t>(w)] = c;
  };
  std::vector<std::thread> threads;
  for (int w = 1; w < workers; ++w) threads.emplace_back(work, w);
  work(0);
  for (auto& th : threads) th.join();
  for (int w = 0; w < workers; ++w) {
    RebindOutcome& p = partial[static_cast<size_t>(w)];
    out.rebound.insert(out.rebound.end(), p.rebound.begin(), p.rebound.end());
    out.skipped.insert(out.skipped.end(), p.skipped.begin(), p.skipped.end());
    out.failed.insert(out.failed.end(), p.failed.begin(), p.failed.end());
    out.stacked_removed += p.stacked_removed;
    changed = changed || changed_by[static_cast<size_t>(w)];
  }
  if (changed) {
    if (auto s = ctx.store->SaveBlocking(v); !s.ok()) return s;
  }
  out.volume = std::move(v);
  return out;
}

}  // namespace fusekeeper
