#include "agent/kube/token_file.h"

#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/strip.h"
#include "glog/logging.h"

namespace fusekeeper {

TokenFile::TokenFile(BlockingPool& pool, std::string path, absl::Duration retry)
    : pool_(pool), path_(std::move(path)), retry_(retry) {}

void TokenFile::Refresh(absl::AnyInvocable<void()> then) {
  if (path_.empty() || absl::Now() < next_read_) return then();
  waiting_.push_back(std::move(then));
  if (reading_) return;
  reading_ = true;
  auto token = std::make_shared<std::string>();
  absl::Status s = pool_.Submit(
      "read service account token",
      [file = path_, token] {
        std::ifstream in(file);
        std::stringstream ss;
        ss << in.rdbuf();
        *token = std::string(absl::StripAsciiWhitespace(ss.str()));
      },
      [this, token](absl::Status ran) {
        reading_ = false;
        if (ran.ok() && !token->empty()) {
          value_ = std::move(*token);
          next_read_ = absl::Now() + absl::Minutes(1);
        } else {
          LOG(WARNING) << "cannot read the service account token " << path_;
          next_read_ = absl::Now() + retry_;
        }
        auto waiting = std::move(waiting_);
        waiting_.clear();
        for (auto& w : waiting) w();
      });
  if (!s.ok()) {
    reading_ = false;
    next_read_ = absl::Now() + retry_;
    auto waiting = std::move(waiting_);
    waiting_.clear();
    for (auto& w : waiting) w();
  }
}

}  // namespace fusekeeper
