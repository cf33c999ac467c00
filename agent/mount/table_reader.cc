#include "agent/mount/table_reader.h"

#include <fcntl.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "agent/base/status.h"

namespace fusekeeper {

absl::StatusOr<std::unique_ptr<MountTableReader>> MountTableReader::Create(Loop& loop,
                                                                           const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open", path);
  return std::unique_ptr<MountTableReader>(new MountTableReader(loop, UniqueFd(fd)));
}

void MountTableReader::Read(Callback done) {
  waiters_.push_back(std::move(done));
  if (waiters_.size() > 1) return;  // a read is already in flight; share it
  filled_ = 0;
  ReadChunk();
}

MountTableReader::MountTableReader(Loop& loop, UniqueFd fd) : loop_(loop), fd_(std::move(fd)) {
  // Set once: a callback must never replace itself while it runs.
  read_.callback = [this](int32_t res, bool) {
    if (res < 0) {
      Finish(ErrnoStatus(-res, "reading mountinfo"));
      return;
    }
    if (res == 0) {
      absl::StatusOr<MountTable> table = MountTable::Parse(std::string(buffer_.data(), filled_));
      if (!table.ok()) {
        Finish(table.status());
      } else {
        Finish(std::make_shared<const MountTable>(std::move(*table)));
      }
      return;
    }
    filled_ += static_cast<size_t>(res);
    ReadChunk();
  };
}

void MountTableReader::ReadChunk() {
  if (buffer_.size() < filled_ + kChunkBytes) buffer_.resize(filled_ + kChunkBytes);
  // The offset restarts the seq_file at 0 for the first chunk of every read.
  loop_.Read(&read_, fd_.get(), buffer_.data() + filled_, kChunkBytes, filled_);
}

void MountTableReader::Finish(absl::StatusOr<std::shared_ptr<const MountTable>> result) {
  std::vector<Callback> waiters;
  waiters.swap(waiters_);
  for (Callback& cb : waiters) cb(result);
}

}  // namespace fusekeeper
