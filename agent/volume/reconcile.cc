#include "agent/volume/reconcile.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace fusekeeper {
namespace {

bool IsOurs(const MountEntry* e, const state::Volume& v, const state::MountIdentity& id,
            bool pending) {
  if (e == nullptr) return false;
  if (pending && v.kind() == "fuse") {
    // A FUSE mount's device only exists once it is mounted, so intent cannot record it: ours is
    // the FUSE mount of our subtype whose source is the volume id (what MountFuseBlocking sets).
    const std::string subtype = v.fuse().subtype().empty() ? "fusekeeper" : v.fuse().subtype();
    return e->fs_type == absl::StrCat("fuse.", subtype) && e->source == v.volume_id();
  }
  if (pending) return e->major == v.source_dev_major() && e->minor == v.source_dev_minor();
  return e->major == id.dev_major() && e->minor == id.dev_minor() && e->root == id.root();
}

state::MountIdentity IdentityOf(const MountEntry& e) {
  state::MountIdentity id;
  id.set_dev_major(e.major);
  id.set_dev_minor(e.minor);
  id.set_root(std::string(e.root));
  return id;
}

// A FUSE volume's source device is its connection's, known only once mounted: record it when a
// pending FUSE mount is adopted (publishes compare their targets against it).
void AdoptFuseSource(const MountEntry& e, state::Volume* v) {
  if (v->kind() != "fuse") return;
  v->set_source_dev_major(e.major);
  v->set_source_dev_minor(e.minor);
}

}  // namespace

std::string StagingMountPath(const state::Volume& v) {
  return v.is_directory() ? v.staging_path() : absl::StrCat(v.staging_path(), "/hostpath");
}

ReconcileOutcome Reconcile(std::vector<state::Volume> volumes, const MountTable& table,
                           const std::function<std::string(const std::string&)>& to_table) {
  ReconcileOutcome out;
  for (state::Volume& v : volumes) {
    bool changed = false;
    const std::string& id = v.volume_id();
    if (!v.staging_path().empty()) {
      const std::string path = StagingMountPath(v);
      const MountEntry* top = table.FindTop(to_table(path));
      if (v.staging_pending()) {
        if (IsOurs(top, v, v.staging_mount(), true)) {
          *v.mutable_staging_mount() = IdentityOf(*top);
          AdoptFuseSource(*top, &v);
          v.set_staging_pending(false);
          out.notes.push_back(absl::StrCat("volume ", id, ": adopted staging mount at ", path));
        } else {
          v.clear_staging_path();
          v.clear_staging_fingerprint();
          v.set_staging_pending(false);
          v.clear_staging_mount();
          out.notes.push_back(absl::StrCat("volume ", id, ": staging at ", path,
                                           " never completed; forgotten"));
        }
        changed = true;
      } else if (!IsOurs(top, v, v.staging_mount(), false)) {
        out.notes.push_back(absl::StrCat("volume ", id, ": staging mount at ", path,
                                         " is gone; publishing will report it"));
      }
    }
    auto* targets = v.mutable_targets();
    for (int i = targets->size() - 1; i >= 0; --i) {
      state::Target& t = targets->at(i);
      const MountEntry* top = table.FindTop(to_table(t.path()));
      if (t.pending()) {
        if (IsOurs(top, v, t.mount(), true)) {
          *t.mutable_mount() = IdentityOf(*top);
          if (v.staging_path().empty()) AdoptFuseSource(*top, &v);
          t.set_pending(false);
          out.notes.push_back(absl::StrCat("volume ", id, ": adopted mount at ", t.path()));
        } else {
          out.notes.push_back(absl::StrCat("volume ", id, ": publish at ", t.path(),
                                           " never completed; forgotten"));
          targets->DeleteSubrange(i, 1);
        }
        changed = true;
      } else if (!IsOurs(top, v, t.mount(), false) && top != nullptr && !v.staging_path().empty() &&
                 !v.staging_pending() && top->major == v.staging_mount().dev_major() &&
                 top->minor == v.staging_mount().dev_minor()) {
        // Re-bound onto the current global mount by a recovery the previous agent did not get
        // to record: adopt it, on the base it was stacked on.
        if (!t.has_base()) *t.mutable_base() = t.mount();
        *t.mutable_mount() = IdentityOf(*top);
        out.notes.push_back(absl::StrCat("volume ", id, ": adopted re-bound mount at ", t.path()));
        changed = true;
      } else if (!IsOurs(top, v, t.mount(), false) && top != nullptr && v.kind() == "fuse" &&
                 (top->fs_type == "fuse" || absl::StartsWith(top->fs_type, "fuse."))) {
        // A bind of an older FUSE connection: broken, not gone. Recovery's audit re-binds it.
        out.notes.push_back(absl::StrCat("volume ", id, ": ", t.path(), " shows an older FUSE connection; "
                                         "recovery will re-bind it"));
      } else if (!IsOurs(top, v, t.mount(), false)) {
        out.notes.push_back(absl::StrCat("volume ", id, ": mount at ", t.path(), " is gone; forgotten"));
        targets->DeleteSubrange(i, 1);
        changed = true;
      }
    }
    if (v.staging_path().empty() && v.targets_size() == 0) {
      out.remove.push_back(id);
      continue;
    }
    if (changed) out.save.push_back(v);
    out.volumes.push_back(std::move(v));
  }
  return out;
}

}  // namespace fusekeeper
