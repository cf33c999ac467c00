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
#include "agent/fkserve/stop_signals.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/version.h"

namespace fusekeeper {
namespace {

constexpr int kWatchPollMs = 200;

HandoffReply Named(HandoffReply r) {
  r.server = ServerName();
  return r;
}

}  // namespace

std::string ServerName() { return absl::StrCat("fkserve ", kVersion); }

void ReplyToAgent(int sock, bool ok, const std::string& error, bool fresh, const std::string& init, bool relayed,
                  int relay_state) {
  HandoffReply r;
  r.relayed = relayed;
  r.relay_state = relay_state >= 0;
  r.ok = ok;
  r.error = error;
  r.fresh = fresh;
  r.init = init;
  r.server = ServerName();
  auto s = SendHandoffMessage(sock, EncodeHandoffReply(r), relay_state);
  if (!s.ok()) fprintf(stderr, "fkserve: replying to the agent: %s\n", std::string(s.message()).c_str());
}

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
  auto s = SendHandoffMessage(sock_.get(), EncodeHandoffReply(Named(r)), -1);
  if (!s.ok()) fprintf(stderr, "fkserve: %s: %s\n", what, std::string(s.message()).c_str());
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
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path_.size() >= sizeof(addr.sun_path)) return UniqueFd();
  memcpy(addr.sun_path, socket_path_.data(), socket_path_.size());
  auto delay = std::chrono::milliseconds(20);
  while (!stopping_) {
    UniqueFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      ucred cred{};
      socklen_t len = sizeof(cred);
      if (getsockopt(s.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
          cred.uid != agent_uid_) {
        fprintf(stderr, "fkserve: the peer on %s is not the agent (uid %u); not re-depositing\n",
                socket_path_.c_str(), cred.uid);
        return UniqueFd();
      }
      HandoffReply r;
      r.ok = true;
      r.redeposit = true;
      r.relayed = relayed_;
      r.init = init_;
      r.relay_state = relay_state_.valid();
      r.draining = draining_ && !stop_released_;  // a restarted agent learns it still waits for a successor
      auto sent = SendHandoffMessage(s.get(), EncodeHandoffReply(Named(r)), fuse_dup_.get(), relay_state_.get());
      if (sent.ok()) {
        fprintf(stderr, "fkserve: re-deposited the FUSE connection with the agent\n");
        return s;
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
