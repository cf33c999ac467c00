#include "agent/volume/fuse_volume_ops.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "agent/base/status.h"
#include "agent/fuse/fuse_mount.h"
#include "agent/fuse/handoff_endpoint.h"
#include "agent/mount/mount_ops.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/sys/syscalls.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

std::string Dir(const std::string& path) { return path.substr(0, path.rfind('/')); }
std::string Name(const std::string& path) { return path.substr(path.rfind('/') + 1); }

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
  auto rel = ctx.kubelet->Relative(dir, "socket directory");
  if (!rel.ok()) return rel.status();
  auto fd = ctx.kubelet->OpenPathBlocking(*rel);
  if (!fd.ok()) {
    if (fd.status().code() == absl::StatusCode::kNotFound) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the socket directory ", dir, " does not exist: is the emptyDir named in volume_context "
          "socketVolume mounted in the pod?"));
    }
    return fd.status();
  }
  struct statx stx{};
  if (statx(fd->get(), "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW, STATX_TYPE | STATX_UID, &stx) != 0) {
    return ErrnoStatus(errno, "statx", dir);
  }
  if ((stx.stx_mode & S_IFMT) != S_IFDIR) {
    return absl::FailedPreconditionError(absl::StrCat(dir, " is not a directory"));
  }
  if (stx.stx_uid != 0 && stx.stx_uid != v.fuse().server_uid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the socket directory ", dir, " belongs to uid ", stx.stx_uid, ", neither root nor the "
        "server's uid ", v.fuse().server_uid()));
  }
  return std::move(*fd);
}

}  // namespace

absl::StatusOr<FuseMounted> MountFuseVolumeBlocking(const VolumeOpsContext& ctx, state::Volume v,
                                                    int target_index, std::optional<state::Volume> previous,
                                                    bool socket_in_kubelet_dir) {
  const bool staging = target_index < 0;
  const std::string path = staging ? v.staging_path() : v.targets(target_index).path();
  if (staging) {
    v.set_staging_pending(true);
  } else {
    v.mutable_targets(target_index)->set_pending(true);
  }
  v.set_is_directory(true);
  if (auto s = ctx.store->SaveBlocking(v); !s.ok()) return s;
  auto fail = [&](absl::Status s) {
    absl::Status r = previous ? ctx.store->SaveBlocking(*previous) : ctx.store->RemoveBlocking(v.volume_id());
    if (!r.ok()) LOG(ERROR) << "rolling back state of volume " << v.volume_id() << ": " << r;
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
  FuseMountOptions mo;
  mo.subtype = v.fuse().subtype().empty() ? "fusekeeper" : v.fuse().subtype();
  mo.source = v.volume_id();
  mo.user_id = v.fuse().server_uid();
  mo.group_id = v.fuse().server_gid();
  mo.read_only = v.fuse().read_only() || (!staging && v.targets(target_index).readonly());
  mo.noexec = v.fuse().noexec();
  mo.noatime = v.fuse().noatime();
  mo.max_read = v.fuse().max_read();
  if (auto s = MountFuseBlocking(dev->get(), target->get(), path, mo); !s.ok()) {
    if (created) unlinkat(parent->get(), name.c_str(), AT_REMOVEDIR);
    return fail(s);
  }
  auto mounted = ctx.kubelet->OpenPathBlocking(*rel);
  if (!mounted.ok()) return fail(mounted.status());
  auto facts = LookupMountAtBlocking(mounted->get(), table_path);
  if (!facts.ok()) return fail(facts.status());
  if (!facts->has_value()) return fail(absl::InternalError(absl::StrCat("FUSE mount at ", path, " vanished")));
  state::MountIdentity id;
  id.set_dev_major((*facts)->dev_major);
  id.set_dev_minor((*facts)->dev_minor);
  id.set_root((*facts)->root);
  id.set_unique_id((*facts)->mnt_id);
  v.set_source_dev_major(id.dev_major());
  v.set_source_dev_minor(id.dev_minor());
  auto listen = HandoffEndpoint::ListenBlocking(socket_dir->get(), Name(v.fuse().socket_path()),
                                                v.fuse().server_uid(), v.fuse().server_gid());
  if (!listen.ok()) {
    mounted->Reset();
    AbortFuseConnectionBlocking(id.dev_minor());
    UnmountAtBlocking(parent->get(), name, table_path);
    if (created) unlinkat(parent->get(), name.c_str(), AT_REMOVEDIR);
    return fail(listen.status());
  }
  if (staging) {
    *v.mutable_staging_mount() = id;
    v.set_staging_pending(false);
  } else {
    state::Target* t = v.mutable_targets(target_index);
    *t->mutable_mount() = id;
    t->set_created(created);
    t->set_pending(false);
  }
  if (auto s = ctx.store->SaveBlocking(v); !s.ok()) return s;
  return FuseMounted{std::move(v), std::move(*dev), std::move(*listen)};
}

absl::Status TearDownFuseMountBlocking(const VolumeOpsContext& ctx, const std::string& path,
                                       const state::MountIdentity& id, const state::Volume& v,
                                       bool socket_in_kubelet_dir) {
  // The socket first, so no server can connect to a volume that is going away. Unlinked through
  // its directory, never following a symlink.
  if (!v.fuse().socket_path().empty()) {
    auto dir = OpenSocketDirBlocking(ctx, v, socket_in_kubelet_dir);
    if (dir.ok()) unlinkat(dir->get(), Name(v.fuse().socket_path()).c_str(), 0);
  }
  // Abort next: a dead or hung server then cannot keep the unmount (or anyone) waiting.
  absl::Status aborted = AbortFuseConnectionBlocking(id.dev_minor());
  if (!aborted.ok() && aborted.code() != absl::StatusCode::kNotFound) {
    LOG(WARNING) << "aborting FUSE connection " << id.dev_minor() << " of " << path << ": " << aborted;
  }
  auto rel = ctx.kubelet->Relative(path, "path");
  if (!rel.ok()) return rel.status();
  auto parent = ctx.kubelet->OpenParentBlocking(*rel);
  if (parent.ok()) {
    const std::string name(BaseName(*rel));
    std::optional<sys::MountFacts> top;
    if (auto fd = ctx.kubelet->OpenPathBlocking(*rel); fd.ok()) {
      auto facts = LookupMountAtBlocking(fd->get(), ctx.kubelet->MountTablePath(path));
      if (facts.ok()) top = std::move(*facts);
    }
    if (top.has_value() && top->dev_major == id.dev_major() && top->dev_minor == id.dev_minor()) {
      absl::Status s = UnmountAtBlocking(parent->get(), name, ctx.kubelet->MountTablePath(path));
      if (!s.ok() && s.code() != absl::StatusCode::kNotFound) return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace fusekeeper
