// MountTableReader: reads /proc/self/mountinfo through the ring. procfs reads cannot be done
// non-blocking, so io_uring runs them in its worker threads; the loop thread only parses.
// Concurrent requests while a read is in flight share that read's result.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "agent/base/unique_fd.h"
#include "agent/loop/loop.h"
#include "agent/mount/mountinfo.h"

namespace fusekeeper {

class MountTableReader {
 public:
  using Callback = absl::AnyInvocable<void(absl::StatusOr<std::shared_ptr<const MountTable>>)>;

  // Opens the file (a procfs open does not block). `path` is for tests.
  static absl::StatusOr<std::unique_ptr<MountTableReader>> Create(
      Loop& loop, const std::string& path = "/proc/self/mountinfo");
  // Must outlive any read in flight: destroy after the loop has stopped.
  ~MountTableReader() = default;

  // Loop thread. Reads and parses the whole table; done runs on the loop thread.
  void Read(Callback done);

 private:
  MountTableReader(Loop& loop, UniqueFd fd);
  void ReadChunk();
  void Finish(absl::StatusOr<std::shared_ptr<const MountTable>> result);

  static constexpr size_t kChunkBytes = 64 * 1024;
  Loop& loop_;
  UniqueFd fd_;
  Completion read_;
  std::string buffer_;
  size_t filled_ = 0;
  std::vector<Callback> waiters_;
};

}  // namespace fusekeeper
