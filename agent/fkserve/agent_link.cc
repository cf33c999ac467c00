#include "agent/fkserve/agent_link.h"


#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "agent/fkserve/drain_gate.h"
#include "agent/fkserve/handoff_client.h"
#include "agent/fkserve/stop_signals.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/version.h"

namespace fusekeeper {
namespace {

constexpr int kWatchPollMs = 200;

}  // namespace

AgentLink::AgentLink(UniqueFd sock, UniqueFd fuse_dup, std::string init, std::string socket_path, uid_t agent_uid)
    : init_(std::move(init)),
      socket_path_(std::move(socket_path)),
      agent_uid_(agent_uid),
      fuse_dup_(std::move(fuse_dup)),
      sock_(std::move(sock)) {}

AgentLink::~AgentLink() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
}

void AgentLink::set_drain_ms(int64_t ms) {
  if (ms <= 0) return;
  if (!ArmDrainGate()) {
    fprintf(stderr, "fkserve: cannot hold stop signals: no draining\n");
    return;
  }
  drain_ms_ = ms;
}

void AgentLink::Start() {
  // Stop signals (SIGTERM from kubelet) go to the serving thread, whose blocking read they must
  // interrupt.
  thread_ = StartWithoutStopSignals([this] { Run(); });
}

void AgentLink::Report(bool ok, const std::string& error) {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  HandoffReply r;
  r.ok = ok;
  r.error = error;
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
  std::lock_guard<std::mutex> lock(mu_);
  if (!sock_) return;
  SendToAgent(sock_.get(), r, what);
}

void AgentLink::CheckDrain() {
  if (drain_ms_ <= 0 || stop_released_ || !DrainHeld()) return;
  if (!draining_) {
    draining_ = true;
    drain_deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(drain_ms_);
    fprintf(stderr, "fkserve: asked to stop; serving on until the agent's successor server waits (at most %lld ms)\n",
            static_cast<long long>(drain_ms_));
    HandoffReply r;
    r.ok = true;
    r.draining = true;
    Send(r, "telling the agent");
    return;
  }
  if (std::chrono::steady_clock::now() >= drain_deadline_) StopServing("no successor came within the drain time");
}

void AgentLink::StopServing(const char* why) {
  if (stop_released_) return;
  stop_released_ = true;
  fprintf(stderr, "fkserve: stopping: %s\n", why);
  ReleaseDrainGate();
}

void AgentLink::Run() {
  while (!stopping_) {
    int fd;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fd = sock_.get();
    }
    if (fd < 0) return;
    CheckDrain();
    pollfd p[2] = {{fd, POLLIN | POLLRDHUP, 0}, {DrainGateFd(), POLLIN, 0}};
    const bool gate = drain_ms_ > 0 && !draining_ && p[1].fd >= 0;
    if (poll(p, gate ? 2 : 1, kWatchPollMs) <= 0 || (p[0].revents == 0)) continue;
    char buf[kMaxHandoffMessageBytes];
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n > 0 && draining_ && IsStopRequest(absl::string_view(buf, static_cast<size_t>(n)))) {
      StopServing("the agent's successor server waits to take over");
      continue;
    }
    if (n > 0) {
      // The agent does not speak on a serving connection except to refuse a re-deposit (or to
      // end a drain).
      fprintf(stderr, "fkserve: the agent did not take the re-deposited connection: %.*s\n",
              static_cast<int>(n), buf);
      return;
    }
    fprintf(stderr, "fkserve: the agent closed the handoff connection; re-depositing the FUSE connection "
                    "when it listens again\n");
    UniqueFd next = Redeposit();
    std::lock_guard<std::mutex> lock(mu_);
    sock_ = std::move(next);
  }
}

UniqueFd AgentLink::Redeposit() {
  auto delay = std::chrono::milliseconds(20);
  while (!stopping_) {
    absl::StatusOr<UniqueFd> s = TryConnectToAgent(socket_path_, agent_uid_);
    if (absl::IsPermissionDenied(s.status()) || absl::IsInvalidArgument(s.status())) {
      fprintf(stderr, "fkserve: %s; not re-depositing\n", std::string(s.status().message()).c_str());
      return UniqueFd();
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
        return std::move(*s);
      }
    }
    // The agent is not listening yet (ENOENT, ECONNREFUSED): it is restarting. A drain goes on
    // meanwhile, to its deadline.
    CheckDrain();
    std::this_thread::sleep_for(delay);
    delay = std::min(delay * 2, std::chrono::milliseconds(1000));
  }
  return UniqueFd();
}

}  // namespace fusekeeper
