#include "agent/fkserve/backing_client.h"

#include <sys/socket.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace fusekeeper {

void BackingClient::SetSocket(UniqueFd sock) {
  std::lock_guard<std::mutex> lock(mu_);
  sock_ = std::move(sock);
  abandoned_.clear();  // their answers would have come on the connection that ended
  paused_until_ = {};  // a new agent (or none) is asked afresh
  if (sock_) return;
  for (auto& [id, answer] : waiting_) {
    if (!answer) answer = BackingReply{id, 0, "the connection to the agent ended"};
  }
  cv_.notify_all();
}

absl::StatusOr<int32_t> BackingClient::Open(int fd, std::chrono::milliseconds timeout,
                                            std::chrono::milliseconds pause) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!enabled_) return absl::FailedPreconditionError("passthrough is off for this connection");
  if (!sock_) return absl::UnavailableError("no connection to the agent");
  if (std::chrono::steady_clock::now() < paused_until_) {
    return absl::UnavailableError("the agent did not answer in time a moment ago; not asking for a while");
  }
  const uint64_t id = ++next_id_;
  // One message per request; SEQPACKET sends are whole, so requests from threads never mix.
  if (auto s = SendHandoffMessage(sock_.get(), EncodeBackingRequest(BackingRequest{id, true, 0}), fd); !s.ok()) {
    return s;
  }
  auto& slot = waiting_[id];
  const bool answered = cv_.wait_for(lock, timeout, [&] { return slot.has_value(); });
  BackingReply reply = answered ? *slot : BackingReply{id, 0, "the agent did not answer in time"};
  waiting_.erase(id);
  if (!answered) {
    abandoned_.insert(id);  // a registration that comes later is closed (Deliver)
    paused_until_ = std::chrono::steady_clock::now() + pause;
  }
  if (reply.error.empty()) {
    ++opened_;
    return reply.backing_id;
  }
  // Refusals that say passthrough cannot work on this connection: asking again would only cost
  // every open a round trip.
  if (IsFinalBackingRefusal(reply.error)) enabled_ = false;
  return absl::FailedPreconditionError(reply.error);
}

void BackingClient::Close(int32_t backing_id) {
  std::lock_guard<std::mutex> lock(mu_);
  CloseLocked(backing_id);
}

void BackingClient::CloseLocked(int32_t backing_id) {
  if (!sock_) return;  // the agent closes what a server left when its connection ends
  (void)SendHandoffMessage(sock_.get(), EncodeBackingRequest(BackingRequest{++next_id_, false, backing_id}), -1);
}

void BackingClient::Deliver(const BackingReply& reply) {
  std::lock_guard<std::mutex> lock(mu_);
  if (abandoned_.erase(reply.id) != 0) {
    // The open it was for went on without it: nothing will name this id.
    if (reply.error.empty() && reply.backing_id > 0) CloseLocked(reply.backing_id);
    return;
  }
  auto it = waiting_.find(reply.id);
  if (it == waiting_.end()) return;  // a close's answer
  it->second = reply;
  cv_.notify_all();
}

bool BackingClient::enabled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return enabled_;
}

int64_t BackingClient::opened() const {
  std::lock_guard<std::mutex> lock(mu_);
  return opened_;
}

}  // namespace fusekeeper
