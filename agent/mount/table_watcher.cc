#include "agent/mount/table_watcher.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>

#include <cstring>

#include "agent/base/status.h"
#include "glog/logging.h"

namespace fusekeeper {

absl::StatusOr<std::unique_ptr<MountTableWatcher>> MountTableWatcher::Start(Loop& loop, OnChange on_change,
                                                                            const std::string& path) {
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return ErrnoStatus(errno, "open", path);
  std::unique_ptr<MountTableWatcher> w(new MountTableWatcher(loop, std::move(fd), std::move(on_change)));
  w->Arm();
  return w;
}

MountTableWatcher::MountTableWatcher(Loop& loop, UniqueFd fd, OnChange on_change)
    : loop_(loop), fd_(std::move(fd)), on_change_(std::move(on_change)) {
  // Set once: Arm() runs from inside this callback, which must not be replaced while it runs.
  poll_.callback = [this, alive = alive_.token()](int32_t res, bool more) {
    if (!alive.alive()) return;
    if (!more) armed_ = false;
    if (res == -ECANCELED) return;
    if (res < 0) {
      LOG(WARNING) << "watching the mount table: " << strerror(-res);
    } else {
      ++changes_seen_;
      Fire();
    }
    // A multishot poll can end (e.g. on overflow); re-arm it.
    if (!more && !armed_ && loop_.running()) Arm();
  };
}

MountTableWatcher::~MountTableWatcher() {
  alive_.End();
  if (armed_ && loop_.running()) loop_.Cancel(&poll_);
}

void MountTableWatcher::Arm() {
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_poll_multishot(sqe, fd_.get(), POLLPRI);
  armed_ = true;
  loop_.Arm(sqe, &poll_);
}

void MountTableWatcher::Fire() {
  if (handling_) {
    dirty_ = true;
    return;
  }
  handling_ = true;
  dirty_ = false;
  on_change_([this, alive = alive_.token()] {
    if (!alive.alive()) return;
    handling_ = false;
    if (dirty_) Fire();
  });
}

}  // namespace fusekeeper
