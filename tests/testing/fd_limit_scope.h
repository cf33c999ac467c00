// FdLimitScope: this process out of fds, for a test's while. The soft RLIMIT_NOFILE is lowered
// to the lowest free fd plus `spare`, so that only `spare` more fds can be had (threads share
// the limit: the loop's accepts, a pool's opens); the limit as it was comes back at destruction.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

namespace fusekeeper {

class FdLimitScope {
 public:
  explicit FdLimitScope(int spare = 0) {
    const int lowest_free = dup(0);
    if (lowest_free < 0 || getrlimit(RLIMIT_NOFILE, &before_) != 0) return;
    close(lowest_free);
    rlimit low = before_;
    low.rlim_cur = static_cast<rlim_t>(lowest_free + spare);
    ok_ = setrlimit(RLIMIT_NOFILE, &low) == 0;
  }
  ~FdLimitScope() { Restore(); }
  FdLimitScope(const FdLimitScope&) = delete;
  FdLimitScope& operator=(const FdLimitScope&) = delete;

  bool ok() const { return ok_; }
  // The limit as it was, before the scope ends.
  void Restore() {
    if (ok_) setrlimit(RLIMIT_NOFILE, &before_);
    ok_ = false;
  }

 private:
  rlimit before_{};
  bool ok_ = false;
};

}  // namespace fusekeeper
