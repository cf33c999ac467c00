// TokenFile: a projected service account token. Kubernetes rotates it, so it is read again
// (on the BlockingPool, never on the loop) when the copy in memory is older than a minute.
#pragma once

#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/time/time.h"
#include "agent/loop/blocking_pool.h"

namespace fusekeeper {

class TokenFile {
 public:
  // `path` empty: there is no token (every Refresh completes at once). After a failed read the
  // next try is `retry` later; the last good token stays in use meanwhile.
  TokenFile(BlockingPool& pool, std::string path, absl::Duration retry);

  // Loop thread. Runs `then` once the token is fresh: at once, or after the read this starts (or
  // one already in flight) has finished.
  void Refresh(absl::AnyInvocable<void()> then);
  const std::string& value() const { return value_; }
  const std::string& path() const { return path_; }

 private:
  BlockingPool& pool_;
  const std::string path_;
  const absl::Duration retry_;
  std::string value_;
  absl::Time next_read_ = absl::InfinitePast();
  bool reading_ = false;
  std::vector<absl::AnyInvocable<void()>> waiting_;
};

}  // namespace fusekeeper
