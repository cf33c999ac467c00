#include "agent/volume/audits.h"

#include <chrono>

#include "glog/logging.h"

namespace fusekeeper {

std::unique_ptr<Audits> Audits::Start(Loop& loop, VolumeManager& volumes, absl::Duration period,
                                      std::function<void()> on_table_change) {
  std::unique_ptr<Audits> a(new Audits(loop, volumes, period));
  volumes.Audit("start-up");
  auto w = MountTableWatcher::Start(loop, [&volumes, on_table_change](MountTableWatcher::Done done) {
    if (on_table_change) on_table_change();
    volumes.Audit("mount table changed", std::move(done));
  });
  if (w.ok()) {
    a->watcher_ = std::move(*w);
  } else {
    LOG(WARNING) << "no mount-table change events (" << w.status() << "); recovery relies on the periodic audit";
  }
  a->timer_.Arm(absl::ToChronoNanoseconds(period), [raw = a.get()] { raw->Periodic(); });
  return a;
}

void Audits::Periodic() {
  volumes_.Audit("periodic audit");
  timer_.Arm(absl::ToChronoNanoseconds(period_), [this] { Periodic(); });
}

}  // namespace fusekeeper
