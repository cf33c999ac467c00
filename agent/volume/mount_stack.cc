#include "agent/volume/mount_stack.h"

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "agent/fuse/fuse_mount.h"
#include "agent/mount/mount_ops.h"
#include "agent/mount/mountinfo.h"
#include "glog/logging.h"

namespace fusekeeper {

const state::MountIdentity& TargetBase(const state::Target& t) { return t.has_base() ? t.base() : t.mount(); }

const state::MountIdentity& StagingBase(const state::Volume& v) {
  return v.has_staging_base() ? v.staging_base() : v.staging_mount();
}

PathMounts MountsAt(const state::Volume& v, const std::string& path) {
  for (const auto& t : v.targets()) {
    if (t.path() == path) return {t.mount(), TargetBase(t)};
  }
  if (!v.staging_path().empty() && v.staging_path() == path) return {v.staging_mount(), StagingBase(v)};
  return {};
}

state::MountIdentity IdentityOf(const sys::MountFacts& f) {
  state::MountIdentity id;
  id.set_dev_major(f.dev_major);
  id.set_dev_minor(f.dev_minor);
  id.set_root(f.root);
  id.set_unique_id(f.mnt_id);
  return id;
}

bool IsFuseFsType(const std::string& fs_type) { return fs_type == "fuse" || absl::StartsWith(fs_type, "fuse."); }

bool SameDev(const sys::MountFacts& f, const state::MountIdentity& id) {
  return f.dev_major == id.dev_major() && f.dev_minor == id.dev_minor();
}

bool IsMount(const sys::MountFacts& f, const state::MountIdentity& id) {
  if (f.mnt_id != 0 && id.unique_id() != 0) return f.mnt_id == id.unique_id();
  return SameDev(f, id) && f.root == id.root();
}

bool VisibleThroughBase(const sys::MountFacts& top, const state::MountIdentity& base) {
  if (top.mnt_id == 0 || base.unique_id() == 0) return true;
  return top.mnt_id == base.unique_id() || top.parent_id == base.unique_id();
}

absl::StatusOr<std::optional<sys::MountFacts>> TopOfBlocking(const KubeletDir& kubelet, const std::string& path) {
  auto rel = kubelet.Relative(path, "path");
  if (!rel.ok()) return rel.status();
  auto fd = kubelet.OpenPathBlocking(*rel);
  if (!fd.ok()) {
    if (fd.status().code() == absl::StatusCode::kNotFound) return std::optional<sys::MountFacts>();
    return fd.status();
  }
  return LookupMountAtBlocking(fd->get(), kubelet.MountTablePath(path));
}

absl::StatusOr<std::vector<sys::MountFacts>> LayersAtBlocking(const KubeletDir& kubelet, const std::string& path) {
  std::vector<sys::MountFacts> layers;
  const std::string table_path = kubelet.MountTablePath(path);
  if (!sys::HaveStatmount()) {
    std::ifstream in("/proc/self/mountinfo");
    std::stringstream text;
    text << in.rdbuf();
    auto table = MountTable::Parse(text.str());
    if (!table.ok()) return table.status();
    for (const MountEntry* e : table->FindAll(table_path)) layers.push_back(FactsOf(*e));
    return layers;
  }
  auto top = TopOfBlocking(kubelet, path);
  if (!top.ok()) return top.status();
  if (!top->has_value()) return layers;
  layers.push_back(std::move(**top));
  while (static_cast<int>(layers.size()) <= kMaxMountLayers) {
    sys::MountFacts below;
    if (sys::StatMount(layers.back().parent_id, &below) != 0 || below.mount_point != table_path) break;
    layers.push_back(std::move(below));
  }
  return layers;
}

void AbortConnectionsAtBlocking(const KubeletDir& kubelet, const std::string& path,
                                const std::vector<uint32_t>& minors) {
  auto layers = LayersAtBlocking(kubelet, path);
  if (!layers.ok()) {
    LOG(WARNING) << "not aborting FUSE connections of " << path << ": " << layers.status();
    return;
  }
  std::set<uint32_t> done;
  for (const uint32_t minor : minors) {
    if (!done.insert(minor).second) continue;
    const bool here = std::any_of(layers->begin(), layers->end(), [minor](const sys::MountFacts& f) {
      return f.dev_major == 0 && f.dev_minor == minor && IsFuseFsType(f.fs_type);
    });
    if (!here) {
      LOG(INFO) << "not aborting FUSE connection " << minor << ": no FUSE mount of it is at " << path
                << " (a saved number may belong to another file system after a reboot)";
      continue;
    }
    absl::Status aborted = AbortFuseConnectionBlocking(minor);
    if (!aborted.ok() && aborted.code() != absl::StatusCode::kNotFound) {
      LOG(WARNING) << "aborting FUSE connection " << minor << " of " << path << ": " << aborted;
    }
  }
}

bool ReidentifyBlocking(const KubeletDir& kubelet, const std::string& path, state::MountIdentity* top,
                        state::MountIdentity* base) {
  auto layers = LayersAtBlocking(kubelet, path);  // top first
  if (!layers.ok()) {
    LOG(WARNING) << "cannot look at the mounts at " << path << " (" << layers.status()
                 << "); their recorded ids are dropped";
  }
  const std::vector<sys::MountFacts> none;
  const std::vector<sys::MountFacts>& at = layers.ok() ? *layers : none;
  auto same = [](const sys::MountFacts& f, const state::MountIdentity& id) {
    return SameDev(f, id) && f.root == id.root();
  };
  bool changed = false;
  auto set = [&changed](state::MountIdentity* id, uint64_t unique_id) {
    if (id->unique_id() == unique_id) return;
    id->set_unique_id(unique_id);
    changed = true;
  };
  state::MountIdentity* lowest = base != nullptr ? base : top;
  int base_index = -1;
  for (int i = static_cast<int>(at.size()) - 1; i >= 0 && base_index < 0; --i) {
    if (same(at[i], *lowest)) base_index = i;
  }
  set(lowest, base_index >= 0 ? at[base_index].mnt_id : 0);
  if (base != nullptr) {
    const int above = base_index >= 0 ? base_index : static_cast<int>(at.size());
    int top_index = -1;
    for (int i = 0; i < above && top_index < 0; ++i) {
      if (same(at[i], *top)) top_index = i;
    }
    set(top, top_index >= 0 ? at[top_index].mnt_id : 0);
  }
  return changed;
}

absl::StatusOr<Stripped> StripToBaseBlocking(const KubeletDir& kubelet, const std::string& path,
                                             const state::MountIdentity& base,
                                             const std::optional<state::MountIdentity>& live) {
  auto rel = kubelet.Relative(path, "path");
  if (!rel.ok()) return rel.status();
  auto parent = kubelet.OpenParentBlocking(*rel);
  if (!parent.ok()) return parent.status();
  const std::string name(BaseName(*rel));
  const std::string table_path = kubelet.MountTablePath(path);
  Stripped out;
  for (int k = 0; k <= kMaxMountLayers; ++k) {
    // Looked up afresh each time, with no fd kept open on the mount (it would pin it: EBUSY).
    auto layers = LayersAtBlocking(kubelet, path);
    if (!layers.ok()) return layers.status();
    if (layers->empty()) {
      out.top.reset();
      return out;
    }
    out.top = layers->front();
    if (live.has_value() && SameDev(*out.top, *live)) {
      out.live = true;
      return out;
    }
    // By device and root, not by id: an id is only good in the namespace that recorded it.
    if (SameDev(*out.top, base) && out.top->root == base.root()) {
      out.at_base = true;
      return out;
    }
    if (layers->size() == 1) {
      LOG(WARNING) << "the lowest mount at " << path << " (" << out.top->fs_type << " " << out.top->dev_major << ":"
                   << out.top->dev_minor << ") is not the recorded base (" << base.dev_major() << ":"
                   << base.dev_minor() << "); it is kept as the base: running containers may follow it";
      out.at_base = true;
      return out;
    }
    if (!IsFuseFsType(out.top->fs_type)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "something fusekeeper did not mount (", out.top->fs_type, ") is on top of ", path, "; not touching it"));
    }
    if (k == kMaxMountLayers) break;
    absl::Status s = UnmountAtBlocking(parent->get(), name, table_path);
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) return s;
    ++out.removed;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("more than ", kMaxMountLayers, " FUSE mounts are stacked on ", path, "; not touching them"));
}

absl::Status UnmountStackBlocking(const KubeletDir& kubelet, const std::string& path,
                                  const state::MountIdentity& top, const state::MountIdentity& base,
                                  bool fuse_layers) {
  auto rel = kubelet.Relative(path, "path");
  if (!rel.ok()) return rel.status();
  auto parent = kubelet.OpenParentBlocking(*rel);
  if (!parent.ok()) return parent.status().code() == absl::StatusCode::kNotFound ? absl::OkStatus() : parent.status();
  const std::string name(BaseName(*rel));
  const std::string table_path = kubelet.MountTablePath(path);
  auto matches = [](const sys::MountFacts& f, const state::MountIdentity& id) {
    return SameDev(f, id) && f.root == id.root();
  };
  bool base_gone = false;
  for (int i = 0; i < kMaxMountLayers; ++i) {
    auto facts = TopOfBlocking(kubelet, path);
    if (!facts.ok()) return facts.status();
    if (!facts->has_value()) return absl::OkStatus();
    const sys::MountFacts& f = **facts;
    const bool is_base = matches(f, base);
    const bool ours = is_base || matches(f, top) || (fuse_layers && !base_gone && IsFuseFsType(f.fs_type));
    if (!ours) {
      if (i == 0) {
        return absl::FailedPreconditionError(absl::StrCat("something fusekeeper did not mount is mounted at ", path,
                                                          " (", f.fs_type, "); not unmounting it"));
      }
      return absl::OkStatus();
    }
    absl::Status s = UnmountAtBlocking(parent->get(), name, table_path);
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) return s;
    base_gone = base_gone || is_base;
  }
  return absl::OkStatus();
}

}  // namespace fusekeeper
