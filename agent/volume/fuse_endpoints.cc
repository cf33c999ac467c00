#include "agent/volume/fuse_endpoints.h"

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fusekeeper {

void FuseEndpoint::StopAnswerProbe() {
  init_deadline.Cancel();
  if (answer_probe != nullptr) {
    if (answer_probe->pending()) {
      LOG(INFO) << "no longer waiting for " << answer_probe->path() << "'s FUSE server (" << answer_server
                << ") to answer: its connection is going";
    }
    answer_probe->Abandon();
  }
  answer_probe.reset();
}

std::string FuseEndpoints::Key(const std::string& volume_id, const std::string& path) {
  return absl::StrCat(volume_id.size(), ":", volume_id, path);
}

FuseEndpoint* FuseEndpoints::Find(const std::string& volume_id, const std::string& path) {
  auto it = entries_.find(Key(volume_id, path));
  return it == entries_.end() ? nullptr : it->second.get();
}

const FuseEndpoint* FuseEndpoints::Find(const std::string& volume_id, const std::string& path) const {
  auto it = entries_.find(Key(volume_id, path));
  return it == entries_.end() ? nullptr : it->second.get();
}

FuseEndpoint* FuseEndpoints::Find(const std::string& volume_id, const std::string& path, uint64_t serial) {
  FuseEndpoint* e = Find(volume_id, path);
  return e != nullptr && e->serial == serial ? e : nullptr;
}

FuseEndpoint& FuseEndpoints::Add(const std::string& volume_id, const std::string& path) {
  auto& slot = entries_[Key(volume_id, path)];
  CHECK(slot == nullptr) << "volume " << volume_id << ": a second endpoint for " << path;
  slot = std::make_unique<FuseEndpoint>(loop_);
  slot->serial = ++serial_;
  return *slot;
}

std::unique_ptr<FuseEndpoint> FuseEndpoints::Take(const std::string& volume_id, const std::string& path) {
  auto it = entries_.find(Key(volume_id, path));
  if (it == entries_.end()) return nullptr;
  std::unique_ptr<FuseEndpoint> e = std::move(it->second);
  entries_.erase(it);
  return e;
}

}  // namespace fusekeeper
