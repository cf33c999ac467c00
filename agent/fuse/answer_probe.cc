#include "agent/fuse/answer_probe.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <utility>

#include "agent/loop/lifetime.h"

namespace fusekeeper {

std::shared_ptr<AnswerProbe> AnswerProbe::Start(Loop& loop, std::string path, Done done) {
  std::shared_ptr<AnswerProbe> p(new AnswerProbe(loop, std::move(path), std::move(done)));
  p->self_ = p;
  AnswerProbe* raw = p.get();
  raw->completion_.callback = [raw](int32_t res, bool) {
    raw->pending_ = false;
    if (raw->done_) std::exchange(raw->done_, nullptr)(res);
    // Freed after this callback has returned (the callback lives inside the probe).
    DeleteLater(raw->loop_, std::move(raw->self_));
  };
  io_uring_sqe* sqe = loop.GetSqe();
  // FORCE_SYNC: answered by the server, never from the kernel's attribute cache. NOFOLLOW and
  // NO_AUTOMOUNT: the mount's root itself, nothing it might lead to.
  io_uring_prep_statx(sqe, AT_FDCWD, raw->path_.c_str(),
                      AT_STATX_FORCE_SYNC | AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT, STATX_TYPE | STATX_MODE,
                      &raw->stx_);
  loop.Arm(sqe, &raw->completion_);
  return p;
}

}  // namespace fusekeeper
