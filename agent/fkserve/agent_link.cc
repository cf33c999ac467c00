#include "agent/fkserve/agent_link.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "agent/fkserve/handoff_client.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/version.h"

namespace fusekeeper {

AgentLink::AgentLink(Loop& loop, UniqueFd sock, UniqueFd fuse_dup, std::string init, std::string socket_path,
                     uid_t agent_uid)
    : loop_(loop),
      init_(std::move(init)),
      socket_path_(std::move(socket_path)),
      agent_uid_(agent_uid),
      fuse_dup_(std::move(fuse_dup)),
      sock_(std::move(sock)),
      drain_timer_(loop),
      redeposit_timer_(loop) {}

AgentLink::~AgentLink() = default;

void AgentLink::Start() { Watch(); }

void AgentLink::Watch() {
  if (!sock_) return;
  // Ours alone (a fresh socket per connection): a notice never waits on an agent that is not
  // reading.
  fcntl(sock_.get(), F_SETFL, fcntl(sock_.get(), F_GETFL) | O_NONBLOCK);
  if (backing_ != nullptr) backing_->SetSocket(UniqueFd(fcntl(sock_.get(), F_DUPFD_CLOEXEC, 3)));
  watch_ = std::make_unique<PollWatch>(loop_, sock_.get(), POLLIN | POLLRDHUP, /*multishot=*/true,
                                       [this](int res) {
                                         if (res > 0) Readable();
                                       });
}

void AgentLink::Readable() {
  while (sock_) {
    char buf[kMaxHandoffMessageBytes];
    const ssize_t n = recv(sock_.get(), buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n > 0 && draining_ && IsStopRequest(absl::string_view(buf, static_cast<size_t>(n)))) {
      StopServing("the agent's successor server waits to take over");
      continue;
    }
    if (n > 0) {
      auto backing = DecodeBackingReply(absl::string_view(buf, static_cast<size_t>(n)));
      if (backing.ok() && backing->has_value()) {
        if (backing_ != nullptr) backing_->Deliver(**backing);
        continue;
      }
    }
    if (n > 0) {
      // The agent does not speak on a serving connection except to refuse a re-deposit (or to
      // end a drain).
      fprintf(stderr, "fkserve: the agent did not take the re-deposited connection: %.*s\n",
              static_cast<int>(n), buf);
      watch_.reset();
      given_up_ = true;
      if (backing_ != nullptr) backing_->SetSocket(UniqueFd());
      return;
    }
    fprintf(stderr, "fkserve: the agent closed the handoff connection; re-depositing the FUSE connection "
                    "when it listens again\n");
    watch_.reset();
    sock_.Reset();
    if (backing_ != nullptr) backing_->SetSocket(UniqueFd());
    backoff_ = std::chrono::milliseconds(20);
    TryRedeposit();
  }
}

void AgentLink::TryRedeposit() {
  if (given_up_) return;
  // Non-blocking: an agent whose listen queue is full is one that is not listening yet.
  absl::StatusOr<UniqueFd> s = TryConnectToAgent(socket_path_, agent_uid_, /*nonblocking=*/true);
  if (absl::IsPermissionDenied(s.status()) || absl::IsInvalidArgument(s.status())) {
    fprintf(stderr, "fkserve: %s; not re-depositing\n", std::string(s.status().message()).c_str());
    given_up_ = true;
    return;
  }
  if (s.ok()) {
    HandoffReply r;
    r.ok = true;
    r.redeposit = true;
    r.relayed = relayed_;
    r.init = init_;
    r.relay_state = relay_state_.valid();
    r.draining = draining_ && !stop_released_;  // a restarted agent learns it still waits for a successor
    r.server = ServerName();
    auto sent = SendHandoffMessage(s->get(), EncodeHandoffReply(r), fuse_dup_.get(), relay_state_.get());
    if (sent.ok()) {
      fprintf(stderr, "fkserve: re-deposited the FUSE connection with the agent\n");
      sock_ = std::move(*s);
      Watch();
      return;
    }
  }
  // The agent is not listening yet (ENOENT, ECONNREFUSED): it is restarting. A drain goes on
  // meanwhile, to its deadline.
  redeposit_timer_.Arm(backoff_, [this] { TryRedeposit(); });
  backoff_ = std::min(backoff_ * 2, std::chrono::milliseconds(1000));
}

bool AgentLink::HoldStop() {
  if (drain_ms_ <= 0 || stop_released_) return false;
  if (draining_) return true;  // a second SIGTERM: the drain goes on to its end
  draining_ = true;
  fprintf(stderr, "fkserve: asked to stop; serving on until the agent's successor server waits (at most %lld ms)\n",
          static_cast<long long>(drain_ms_));
  HandoffReply r;
  r.ok = true;
  r.draining = true;
  Send(r, "telling the agent");
  drain_timer_.Arm(std::chrono::milliseconds(drain_ms_), [this] { StopServing("no successor came within the drain time"); });
  return true;
}

void AgentLink::StopServing(const std::string& why) {
  if (stop_released_) return;
  stop_released_ = true;
  drain_timer_.Cancel();
  fprintf(stderr, "fkserve: stopping: %s\n", why.c_str());
  if (on_stop_) on_stop_(why);
}

void AgentLink::Report(bool ok, const std::string& error) {
  watch_.reset();
  given_up_ = true;
  if (backing_ != nullptr) backing_->SetSocket(UniqueFd());
  if (!sock_) return;
  HandoffReply r;
  r.ok = ok;
  r.error = error;
  // The last word: worth a bounded wait for room in the agent's queue.
  pollfd p{sock_.get(), POLLOUT, 0};
  poll(&p, 1, 2000);
  Send(r, "reporting to the agent");
}

void AgentLink::Notice(const std::string& text, int64_t restart_ms) {
  HandoffReply r;
  r.ok = true;
  r.notice = text;
  r.restart_ms = restart_ms;
  Send(r, "telling the agent");
}

void AgentLink::Send(const HandoffReply& r, const char* what) {
  if (!sock_) return;
  SendToAgent(sock_.get(), r, what);
}

}  // namespace fusekeeper
