// Reconcile: start-up repair of saved state against the kernel's mount table. Pure logic, so it
// runs on the loop thread and is tested without mounting.
//
//  - pending staging/target (saved, then killed before or after its mount): adopted if a mount of
//    the volume's source device is at the path, dropped otherwise (the retried RPC redoes it);
//  - a completed target whose mount is gone (unpublish killed after unmounting): dropped;
//  - a completed staging whose mount is gone: kept and reported (publish then says so);
//  - a volume left with neither staging nor targets: its state file is removed.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "agent/mount/mountinfo.h"
#include "proto/state.pb.h"

namespace fusekeeper {

struct ReconcileOutcome {
  std::vector<state::Volume> volumes;  // the state to run with
  std::vector<state::Volume> save;     // changed: write back
  std::vector<std::string> remove;     // volume ids whose state file goes
  std::vector<std::string> notes;      // what was repaired, for the log
};

// Paths in state are the RPCs' paths; to_table maps one to what mountinfo shows (the kubelet dir
// may be a symlink).
ReconcileOutcome Reconcile(std::vector<state::Volume> volumes, const MountTable& table,
                           const std::function<std::string(const std::string&)>& to_table);

// The path the staging mount is made on (the staging dir, or the file in it for non-directories).
std::string StagingMountPath(const state::Volume& v);

}  // namespace fusekeeper
