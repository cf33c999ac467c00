#include "agent/fkserve/relay/change_log.h"

namespace fusekeeper::relay {

bool ChangeLog::Add(uint64_t kid, uint64_t kfh, std::string msg, bool durable) {
  NodeChanges& n = nodes_[kid];
  if (n.incomplete) {
    n.unsynced_handles.insert(kfh);
    return false;
  }
  if (n.bytes + msg.size() > max_node_ || total_ + msg.size() > max_total_) {
    MakeIncomplete(n, kfh);
    return false;
  }
  n.bytes += msg.size();
  total_ += msg.size();
  n.changes.push_back(Change{kfh, durable, std::move(msg)});
  Trim(kid, n);
  return true;
}

void ChangeLog::AddUnrepeatable(uint64_t kid, uint64_t kfh) { MakeIncomplete(nodes_[kid], kfh); }

void ChangeLog::MakeIncomplete(NodeChanges& n, uint64_t kfh) {
  // Every handle with a change not yet durable must sync before what is kept is whole again.
  for (const Change& c : n.changes) {
    if (!c.durable) n.unsynced_handles.insert(c.kfh);
  }
  n.unsynced_handles.insert(kfh);
  total_ -= n.bytes;
  n.bytes = 0;
  n.changes.clear();
  n.incomplete = true;
}

void ChangeLog::Synced(uint64_t kid, uint64_t kfh) {
  auto it = nodes_.find(kid);
  if (it == nodes_.end()) return;
  NodeChanges& n = it->second;
  if (n.incomplete) {
    n.unsynced_handles.erase(kfh);
    n.unsynced_handles.erase(0);
    if (n.unsynced_handles.empty()) n.incomplete = false;
  }
  for (Change& c : n.changes) {
    if (c.kfh == kfh || c.kfh == 0) c.durable = true;
  }
  Trim(kid, n);
}

void ChangeLog::Trim(uint64_t kid, NodeChanges& n) {
  while (!n.changes.empty() && n.changes.front().durable) {
    n.bytes -= n.changes.front().msg.size();
    total_ -= n.changes.front().msg.size();
    n.changes.pop_front();
  }
  if (n.changes.empty() && !n.incomplete) nodes_.erase(kid);
}

void ChangeLog::Drop(uint64_t kid) {
  auto it = nodes_.find(kid);
  if (it == nodes_.end()) return;
  total_ -= it->second.bytes;
  nodes_.erase(it);
}

const NodeChanges* ChangeLog::Find(uint64_t kid) const {
  auto it = nodes_.find(kid);
  return it == nodes_.end() ? nullptr : &it->second;
}

}  // namespace fusekeeper::relay
