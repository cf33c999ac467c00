// Recovery's detection beside the FUSE connections' own events: every volume's mounts compared
// with the mount table at start-up, at each mount-table change (MountTableWatcher: POLLPRI on
// the ring), and periodically as a safety net.
//
// Threading: the loop's thread.
#pragma once

#include <functional>
#include <memory>

#include "absl/time/time.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"
#include "agent/mount/table_watcher.h"
#include "agent/volume/volume_manager.h"

namespace fusekeeper {

class Audits {
 public:
  // After `volumes` has reconciled its state. `on_table_change`: each change notification (for
  // metrics). Without change events (an old kernel), the periodic audit is all there is, said.
  static std::unique_ptr<Audits> Start(Loop& loop, VolumeManager& volumes, absl::Duration period,
                                       std::function<void()> on_table_change);
  ~Audits() = default;
  Audits(const Audits&) = delete;
  Audits& operator=(const Audits&) = delete;

 private:
  Audits(Loop& loop, VolumeManager& volumes, absl::Duration period)
      : loop_(loop), volumes_(volumes), period_(period), timer_(loop) {}
  void Periodic();

  Loop& loop_;
  VolumeManager& volumes_;
  const absl::Duration period_;
  std::unique_ptr<MountTableWatcher> watcher_;
  Timer timer_;
};

}  // namespace fusekeeper
