#include "agent/fkserve/relay/node_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fusekeeper::relay {

namespace {
std::string NameKey(uint64_t parent, absl::string_view name) {
  std::string key(reinterpret_cast<const char*>(&parent), sizeof(parent));
  key.append(name.data(), name.size());
  return key;
}
}  // namespace

NodeTable::NodeTable() {
  Node root;
  root.kid = root.pid = kRootId;
  root.kernel_lookups = 1;  // the kernel never forgets the root
  nodes_.emplace(kRootId, root);
  by_pid_[kRootId] = kRootId;
}

Node* NodeTable::Find(uint64_t kid) {
  auto it = nodes_.find(kid);
  return it == nodes_.end() ? nullptr : &it->second;
}

uint64_t NodeTable::KidOfPid(uint64_t pid) const {
  auto it = by_pid_.find(pid);
  return it == by_pid_.end() ? 0 : it->second;
}

uint64_t NodeTable::KidOfName(uint64_t parent, absl::string_view name) const {
  auto it = by_name_.find(NameKey(parent, name));
  return it == by_name_.end() ? 0 : it->second;
}

uint64_t NodeTable::NewKid(uint64_t pid) {
  if (pid != 0 && pid < kFirstAllocatedKid && nodes_.find(pid) == nodes_.end()) return pid;
  while (nodes_.find(next_kid_) != nodes_.end()) ++next_kid_;
  return next_kid_++;
}

void NodeTable::ClearName(Node& n) {
  if (n.parent == 0) return;
  Changed(n.kid);
  if (n.key != nullptr) by_name_.erase(by_name_.find(*n.key));
  const uint64_t parent = n.parent;
  n.parent = 0;
  n.key = nullptr;
  if (Node* p = Find(parent)) {
    --p->children;
    MaybeErase(parent);
  }
}

void NodeTable::SetName(Node& n, uint64_t parent, absl::string_view name) {
  if (n.kid == kRootId || parent == 0) return;  // the root has no name; parent 0: no path
  if (n.parent == parent && n.name() == name) return;
  Node* p = Find(parent);
  if (p == nullptr) return;  // a parent the kernel never got from us: no path
  // A program that names a directory inside itself (a bug, or a directory hard link) gets no
  // path for it: a cycle could never be resolved, nor freed.
  for (uint64_t up = parent; up != 0; up = Find(up)->parent) {
    if (up == n.kid) {
      ClearName(n);
      return;
    }
  }
  ++p->children;  // first: the clears below must not erase the new parent
  // Another node by that name is replaced: it keeps living without a path.
  if (const uint64_t other = KidOfName(parent, name); other != 0 && other != n.kid) {
    NoteLost(*Find(other));
    ClearName(*Find(other));
    MaybeErase(other);
  }
  ClearName(n);
  Changed(n.kid);
  n.parent = parent;
  n.key = &by_name_.insert_or_assign(NameKey(parent, name), n.kid).first->first;
}

void NodeTable::Unbind(Node& n) {
  if (n.kid == kRootId || n.pid == 0) return;
  if (auto it = by_pid_.find(n.pid); it != by_pid_.end() && it->second == n.kid) by_pid_.erase(it);
  n.pid = 0;
}

uint64_t NodeTable::AddKernelEntry(uint64_t parent, absl::string_view name, uint64_t pid) {
  uint64_t kid = KidOfPid(pid);
  if (kid == 0 && parent != 0) {
    // A node the kernel knows by this path, not yet bound in this instance.
    if (const uint64_t named = KidOfName(parent, name); named != 0 && Find(named)->pid == 0) {
      kid = named;
      Node& n = *Find(kid);
      n.pid = pid;
      n.unresolvable = false;
      by_pid_[pid] = kid;
    }
  }
  if (kid == 0) {
    kid = NewKid(pid);
    Node n;
    n.kid = kid;
    n.pid = pid;
    nodes_.emplace(kid, std::move(n));
    by_pid_[pid] = kid;
  }
  Node& n = *Find(kid);
  if (kid != kRootId) {
    if (parent != 0) SetName(n, parent, name);
    ++n.kernel_lookups;
    Changed(kid);
    ++n.program_lookups;
  }
  return kid;
}

void NodeTable::BindResolved(uint64_t kid, uint64_t pid) {
  Node* n = Find(kid);
  if (n == nullptr || kid == kRootId) return;
  if (n->pid != 0 && n->pid != pid) {
    // Bound already (a kernel entry raced the resolution): keep the binding, give the extra
    // reference back.
    forgets_.push_back({pid, 1});
    return;
  }
  n->pid = pid;
  n->unresolvable = false;
  ++n->program_lookups;
  by_pid_.emplace(pid, kid);  // an alias (hard link) keeps the first binding
}

void NodeTable::Forget(uint64_t kid, uint64_t count) {
  Node* n = Find(kid);
  if (n == nullptr || kid == kRootId || count == 0) return;
  n->kernel_lookups -= std::min(count, n->kernel_lookups);
  Changed(kid);
  if (n->kernel_lookups == 0) {
    if (n->pid != 0 && n->program_lookups > 0) forgets_.push_back({n->pid, n->program_lookups});
    n->program_lookups = 0;
    Unbind(*n);
    MaybeErase(kid);
    return;
  }
  // The program keeps at least one reference while the kernel holds any.
  if (n->pid != 0 && n->program_lookups > 1) {
    const uint64_t give = std::min(count, n->program_lookups - 1);
    forgets_.push_back({n->pid, give});
    n->program_lookups -= give;
  }
}

void NodeTable::Rename(uint64_t old_parent, absl::string_view old_name, uint64_t new_parent,
                       absl::string_view new_name, bool exchange) {
  const uint64_t moved = KidOfName(old_parent, old_name);
  const uint64_t other = KidOfName(new_parent, new_name);
  if (exchange) {
    // Both names stay; their nodes swap. Hold both parents while the names are cleared, so that
    // neither is erased on the way.
    Node* np = Find(new_parent);
    Node* op = Find(old_parent);
    if (np == nullptr || op == nullptr) return;
    ++np->children;
    ++op->children;
    if (moved != 0) ClearName(*Find(moved));
    if (other != 0) ClearName(*Find(other));
    if (moved != 0) SetName(*Find(moved), new_parent, new_name);
    if (other != 0) SetName(*Find(other), old_parent, old_name);
    --Find(new_parent)->children;
    MaybeErase(new_parent);
    if (Node* still = Find(old_parent)) {
      --still->children;
      MaybeErase(old_parent);
    }
    return;
  }
  if (moved != 0) {
    SetName(*Find(moved), new_parent, new_name);  // replaces `other`, if any
  } else if (other != 0) {
    NoteLost(*Find(other));
    ClearName(*Find(other));
    MaybeErase(other);
  }
}

void NodeTable::Unlink(uint64_t parent, absl::string_view name) {
  if (const uint64_t kid = KidOfName(parent, name); kid != 0) {
    NoteLost(*Find(kid));
    ClearName(*Find(kid));
    MaybeErase(kid);
  }
}

void NodeTable::AddHandle(uint64_t kid) {
  if (Node* n = Find(kid)) ++n->handles;
}

void NodeTable::DropHandle(uint64_t kid) {
  Node* n = Find(kid);
  if (n == nullptr || n->handles == 0) return;
  --n->handles;
  MaybeErase(kid);
}

void NodeTable::MaybeErase(uint64_t kid) {
  Node* n = Find(kid);
  if (n == nullptr || kid == kRootId) return;
  if (n->kernel_lookups > 0 || n->children > 0 || n->handles > 0) return;
  // A directory kept only as a path to others, resolved in this instance: give its lookup back.
  if (n->pid != 0 && n->program_lookups > 0) forgets_.push_back({n->pid, n->program_lookups});
  Unbind(*n);
  ClearName(*n);  // may erase the parent in turn
  nodes_.erase(kid);
  Changed(kid);
}

std::vector<uint64_t> NodeTable::TakeChanged() {
  std::vector<uint64_t> out;
  out.swap(changed_);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void NodeTable::Restore(const std::map<uint64_t, SavedNode>& saved, const std::vector<uint64_t>& handles) {
  const bool tracking = track_changes_;
  track_changes_ = false;  // what is loaded is in the journal already
  for (const auto& [kid, s] : saved) {
    if (kid == kRootId || kid == 0) continue;
    Node n;
    n.kid = kid;
    n.kernel_lookups = s.kernel_lookups;
    nodes_.emplace(kid, std::move(n));
  }
  for (const auto& [kid, s] : saved) {
    if (s.parent == 0 || kid == kRootId) continue;
    if (Node* n = Find(kid)) SetName(*n, s.parent, s.name);  // refuses cycles and missing parents
  }
  for (uint64_t kid : handles) {
    if (Find(kid) == nullptr) {  // open, but never named: no path
      Node n;
      n.kid = kid;
      nodes_.emplace(kid, std::move(n));
    }
    AddHandle(kid);
  }
  track_changes_ = tracking;  // what is dropped now is recorded as gone
  std::vector<uint64_t> kids;
  for (const auto& [kid, n] : nodes_) kids.push_back(kid);
  for (uint64_t kid : kids) MaybeErase(kid);
  forgets_.clear();  // nothing is bound: nothing is owed to any program
}

void NodeTable::NewInstance() {
  for (auto& [kid, n] : nodes_) {
    if (kid == kRootId) continue;
    n.pid = 0;
    n.program_lookups = 0;
    n.resolving = false;
    n.unresolvable = false;
  }
  by_pid_.clear();
  by_pid_[kRootId] = kRootId;
  forgets_.clear();
  // Nodes kept only as paths to others stay; nothing is owed to the dead instance.
}

std::vector<ProgramForget> NodeTable::TakeForgets() {
  std::vector<ProgramForget> out;
  out.swap(forgets_);
  return out;
}

std::string NodeTable::CheckInvariantsForTest() const {
  std::unordered_map<uint64_t, uint32_t> children;
  for (const auto& [kid, n] : nodes_) {
    if (n.kid != kid) return absl::StrCat("node ", kid, " says it is ", n.kid);
    if (n.parent != 0) {
      if (nodes_.find(n.parent) == nodes_.end()) return absl::StrCat("node ", kid, " names a missing parent ", n.parent);
      ++children[n.parent];
      auto it = by_name_.find(NameKey(n.parent, n.name()));
      if (it == by_name_.end() || it->second != kid || &it->first != n.key) {
        return absl::StrCat("node ", kid, " '", n.name(), "' is not indexed");
      }
    }
    if (kid != kRootId && n.kernel_lookups == 0 && n.children == 0 && n.handles == 0) {
      return absl::StrCat("node ", kid, " is kept with nothing needing it");
    }
    if (kid != kRootId && n.pid != 0 && n.kernel_lookups > 0 && n.program_lookups == 0) {
      return absl::StrCat("node ", kid, " is bound with no program reference while the kernel holds one");
    }
  }
  for (const auto& [kid, n] : nodes_) {
    if (n.children != children[kid]) {
      return absl::StrCat("node ", kid, " counts ", n.children, " children, has ", children[kid]);
    }
  }
  if (by_name_.size() != [&] {
        size_t named = 0;
        for (const auto& [kid, n] : nodes_) named += n.parent != 0;
        return named;
      }()) {
    return "by_name_ holds names no node has";
  }
  for (const auto& [pid, kid] : by_pid_) {
    auto it = nodes_.find(kid);
    if (it == nodes_.end() || it->second.pid != pid) return absl::StrCat("pid ", pid, " maps to ", kid, " wrongly");
  }
  return "";
}

}  // namespace fusekeeper::relay
