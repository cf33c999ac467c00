// NodeTable: what the kernel knows about a relayed file system's nodes, and what the current
// program instance calls them.
//
// The kernel names a node by the id it was given in an entry reply (LOOKUP, MKDIR, CREATE,
// READDIRPLUS...): the *kernel id* (kid). A program names it by its own *program id* (pid), which
// means nothing to the next instance of the program after a restart. The table keeps, for every
// node the kernel holds a lookup reference on (and every directory on the way to one):
//  - its parent's kid and its name (learnt from the traffic, moved by RENAME, cleared by UNLINK,
//    RMDIR, or a name that now means another node): the path by which a new instance finds it;
//  - the kernel's lookup count and the current instance's (they differ after a restart: the
//    relay's own resolving LOOKUP counts one for the program, none for the kernel);
//  - the pid it has in the current instance (0: not looked up yet in this instance).
// A kid is the program's own id in the generation that first returned it, if that id is not
// already a kid; otherwise a fresh one from a range no program uses (kFirstAllocatedKid up).
// The root is kid 1 = pid 1 in every instance.
//
// Invariants (CheckInvariantsForTest): by_name_ and the nodes' (parent, name) agree; every
// node's child count is the number of nodes naming it as parent; by_pid_ maps only to nodes
// bound to that pid; a node stays while the kernel, a child or an open handle needs it; the
// program's count never reaches 0 while the kernel's is above 0 for a bound node.
//
// Not thread-safe: owned by the relay core, on its thread.
#pragma once

#include <stdint.h>

#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "agent/fkserve/relay/relay_state.h"

namespace fusekeeper::relay {

inline constexpr uint64_t kRootId = 1;
inline constexpr uint64_t kFirstAllocatedKid = 1ULL << 56;

struct Node {
  uint64_t kid = 0;
  uint64_t pid = 0;        // in the current instance; 0 = not resolved there
  uint64_t parent = 0;     // kid; 0 = no path (unlinked, replaced, or never named)
  // The name is kept once, in the table's index: this points at its key (parent + name), which
  // stays put while the entry exists (node-based map).
  const std::string* key = nullptr;
  absl::string_view name() const { return key == nullptr ? absl::string_view() : absl::string_view(*key).substr(8); }
  uint64_t kernel_lookups = 0;
  uint64_t program_lookups = 0;  // the current instance's count
  uint32_t children = 0;
  uint32_t handles = 0;
  // Resolution in the current instance (relay_core.cc).
  bool resolving = false;
  bool unresolvable = false;  // its LOOKUP failed in this instance
};

// A FORGET the relay owes the current program instance.
struct ProgramForget {
  uint64_t pid;
  uint64_t count;
};

class NodeTable {
 public:
  NodeTable();

  Node* Find(uint64_t kid);
  size_t size() const { return nodes_.size(); }
  template <typename F>
  void ForEach(F f) const {
    for (const auto& [kid, n] : nodes_) f(n);
  }
  // kid of the node bound to `pid` in the current instance, 0 if none.
  uint64_t KidOfPid(uint64_t pid) const;
  // kid named `name` in `parent`, 0 if none.
  uint64_t KidOfName(uint64_t parent, absl::string_view name) const;

  // An entry reply the kernel will see: `pid` named `name` in `parent` (parent 0: no name, e.g.
  // TMPFILE). Counts one lookup on both sides. Returns the kid to give the kernel.
  uint64_t AddKernelEntry(uint64_t parent, absl::string_view name, uint64_t pid);
  // The relay's own LOOKUP found `kid` as `pid` in the current instance: one program lookup.
  void BindResolved(uint64_t kid, uint64_t pid);
  // The kernel forgot `n` lookups of `kid`. FORGETs owed to the program go to TakeForgets().
  void Forget(uint64_t kid, uint64_t n);
  // A successful RENAME (exchange: RENAME_EXCHANGE swapped the two names).
  void Rename(uint64_t old_parent, absl::string_view old_name, uint64_t new_parent, absl::string_view new_name,
              bool exchange);
  // A successful UNLINK/RMDIR: the node keeps living (open files) but has no path any more.
  void Unlink(uint64_t parent, absl::string_view name);
  void AddHandle(uint64_t kid);
  void DropHandle(uint64_t kid);
  // The program instance died: nothing is bound any more but the root; its counts are gone.
  void NewInstance();

  std::vector<ProgramForget> TakeForgets();

  // Nodes held open (a handle) that lost their path since the last call (unlinked, renamed over,
  // or named by another node), with the name they had: after a restart such a node cannot be
  // reopened, so the relay says so when it happens.
  struct LostPath {
    uint64_t kid;
    std::string name;
  };
  std::vector<LostPath> TakeLostPaths() { return std::exchange(lost_, {}); }

  // Change tracking for the relay's state journal (relay_state.h): once on, every node whose
  // parent, name or kernel lookup count changed, or that was erased, since the last call.
  void TrackChanges() { track_changes_ = true; }
  std::vector<uint64_t> TakeChanged();
  // Loads what a dead launcher's journal says the kernel holds, into a table that holds only the
  // root: every node unbound (resolved by path on first use), `handles` open handles' nodes
  // (a node no record names is kept without a path). Nodes nothing needs are dropped.
  void Restore(const std::map<uint64_t, SavedNode>& nodes, const std::vector<uint64_t>& handles);

  // Empty if every invariant holds, else what does not.
  std::string CheckInvariantsForTest() const;

 private:
  void SetName(Node& n, uint64_t parent, absl::string_view name);
  void ClearName(Node& n);
  void Unbind(Node& n);
  void MaybeErase(uint64_t kid);
  uint64_t NewKid(uint64_t pid);
  void Changed(uint64_t kid) {
    if (track_changes_) changed_.push_back(kid);
  }

  std::unordered_map<uint64_t, Node> nodes_;
  std::unordered_map<uint64_t, uint64_t> by_pid_;
  std::unordered_map<std::string, uint64_t> by_name_;  // NameKey(parent, name)
  uint64_t next_kid_ = kFirstAllocatedKid;
  std::vector<ProgramForget> forgets_;
  std::vector<LostPath> lost_;
  void NoteLost(const Node& n) {
    if (n.handles > 0 && n.parent != 0) lost_.push_back({n.kid, std::string(n.name())});
  }
  bool track_changes_ = false;
  std::vector<uint64_t> changed_;  // may repeat a kid
};

}  // namespace fusekeeper::relay
