// StateStore: one file per volume under <state_dir>/volumes/, named by the SHA-256 of the volume
// id (ids may hold any byte and be 128 bytes long). Writes are atomic (write a temp file in the
// same directory, then rename), so a reader sees the old or the new state, never a torn one. No
// fsync: mounts do not outlive a reboot, and a killed process loses nothing already written.
// All methods block (file I/O): call them on the BlockingPool.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/base/sha256.h"
#include "agent/base/unique_fd.h"
#include "proto/state.pb.h"

namespace fusekeeper {

class StateStore {
 public:
  // Blocking. Creates <dir> (0711), takes <dir>/agent.lock (an exclusive flock held for the
  // store's lifetime: one agent per state dir; FAILED_PRECONDITION naming the holder's pid if
  // another process still holds it after `lock_wait`: an old agent finishing its shutdown during
  // a rollout lets go within its grace) before touching anything else, then creates
  // <dir>/volumes (0700) and removes temp files a killed writer left behind.
  static absl::StatusOr<StateStore> Open(const std::string& dir, absl::Duration lock_wait = absl::ZeroDuration());

  absl::Status SaveBlocking(const state::Volume& volume) const;
  // Records only target `path` of `volume` (its entry in volume.targets(), or its absence: the
  // target is removed) into the saved state of the volume, keeping every other field and target
  // as saved. For work on distinct targets of one staged volume that runs concurrently: each
  // writes its own target, none undoes another's. Serialised per volume; if nothing is saved
  // yet, saves `volume` whole.
  absl::Status SaveTargetBlocking(const state::Volume& volume, const std::string& path) const;
  // Idempotent: removing a volume that has no file is OK.
  absl::Status RemoveBlocking(const std::string& volume_id) const;
  // Every readable volume. Unreadable files are renamed *.corrupt and reported in `problems`.
  absl::StatusOr<std::vector<state::Volume>> LoadAllBlocking(std::vector<std::string>* problems) const;

  const std::string& dir() const { return dir_; }

 private:
  struct VolumeLocks;
  StateStore(std::string dir, UniqueFd lock);
  std::string FileFor(const std::string& volume_id) const;
  std::string dir_;  // <state_dir>/volumes
  UniqueFd lock_;    // <state_dir>/agent.lock, flock(LOCK_EX) held
  std::shared_ptr<VolumeLocks> locks_;  // SaveTargetBlocking's read-modify-write, per volume
};

}  // namespace fusekeeper
