// HandoffEndpoint: after an agent restart, a serving server re-deposits the connection.
#include "agent/fuse/handoff_endpoint.h"

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "agent/base/crash_point.h"
#include "agent/base/status.h"
#include "agent/fuse/fuse_mount.h"
#include "glog/logging.h"

#include "agent/fuse/handoff_endpoint_internal.h"

namespace fusekeeper {

void HandoffEndpoint::AwaitRedeposit(Connection* c) {
  c->peer.Receive(options_.redeposit_wait, [this, c](HandoffPeer::Received got) { OnRedeposit(c, std::move(got)); });
}

void HandoffEndpoint::NothingRedeposited(Connection* c) {
  if (!c->tag.empty()) {
    // A server pod's server with nothing to re-deposit, after an agent restart: another pod's
    // server (the one a roll replaces) may be serving and about to re-deposit. It waits on
    // standby; if nobody re-deposits within standby_redeposit_wait, it gets a fresh connection.
    LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer() << " from " << c->tag
              << " has nothing to re-deposit: it waits on standby for the serving server to re-deposit or stop";
    ToStandby(c);
    if (!standby_fallback_.armed()) {
      standby_fallback_.Arm(absl::ToChronoNanoseconds(options_.standby_redeposit_wait), [this] {
        if (policy_.stopped() || !policy_.awaiting_redeposit() || policy_.serving() || standby_.empty()) return;
        LOG(INFO) << "volume " << config_.volume_id << ": no server re-deposited its connection within "
                  << absl::FormatDuration(options_.standby_redeposit_wait) << "; a server on standby gets a fresh one";
        parked_.push_back(std::move(standby_.front()));
        standby_.pop_front();
        if (events_.on_fresh_requested) events_.on_fresh_requested();
      });
    }
    return;
  }
  // Silent: a server that waits for its config (one that serves nothing yet, or a v1 server).
  LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer() << " did not re-deposit a "
            << "connection within " << absl::FormatDuration(options_.redeposit_wait)
            << " of connecting to the restarted agent; it gets a fresh connection";
  parked_.push_back(TakeConnection(c));
  if (events_.on_fresh_requested) events_.on_fresh_requested();
}

void HandoffEndpoint::OnRedeposit(Connection* c, HandoffPeer::Received got) {
  const int32_t res = got.res;
  std::vector<UniqueFd>& fds = got.fds;
  if (policy_.stopped()) return Finish(c, absl::CancelledError("handoff endpoint stopped"), std::nullopt);
  if (res == -ECANCELED) {
    if (!policy_.awaiting_redeposit()) return Route(c);  // re-deposited meanwhile (by another server)
    return NothingRedeposited(c);
  }
  if (res < 0) return Finish(c, ErrnoStatus(-res, "reading from the server"), std::nullopt);
  if (res == 0) return Finish(c, absl::UnavailableError("the server closed the connection"), std::nullopt);
  auto reply = DecodeHandoffReply(got.message);
  if (!reply.ok()) return Finish(c, reply.status(), std::nullopt);
  if (!reply->ok || !reply->redeposit) {
    return Finish(c, absl::InvalidArgumentError("the server spoke first without re-depositing a connection"),
                  std::nullopt);
  }
  std::string why;
  if (fds.size() != (reply->relay_state ? 2u : 1u) || got.other_control) {
    why = reply->relay_state ? "a re-deposit with a relay state must carry exactly two fds"
                             : "a re-deposit must carry exactly one fd";
  } else if (!policy_.awaiting_redeposit()) {
    why = absl::StrCat("volume ", config_.volume_id, " already has a connection");
  } else {
    why = CheckRedeposited(fds[0].get());
  }
  if (!why.empty()) return SendOffer(c, /*refuse=*/true, why);
  fuse_fd_ = std::move(fds[0]);
  relay_state_.Reset();
  backing_ids_.clear();
  backing_ids_complete_ = false;  // registered before this agent started: unknown here
  ++connection_generation_;
  if (reply->relay_state) KeepRelayState(c, std::move(fds[1]));
  policy_.Redeposited();
  ++redeposits_;
  init_record_ = reply->init;
  LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer() << " re-deposited its live FUSE connection";
  abort_watch_.Watch(fuse_fd_.get());
  Finish(c, absl::OkStatus(), *reply);  // the same server goes on serving: not an adoption
  // It was draining when the agent went away: it still waits for its successor.
  if (reply->draining) MarkDraining(c);
}

void HandoffEndpoint::KeepRelayState(Connection* c, UniqueFd fd) {
  if (!fd.valid() || !IsMemfd(fd.get())) {
    LOG(WARNING) << "volume " << config_.volume_id << ": " << c->Peer()
                 << " says it deposits its relay state, but what it attached is not one memfd; not kept "
                    "(a launcher that replaces it will ask for a fresh connection)";
    return;
  }
  relay_state_ = std::move(fd);
}

std::string HandoffEndpoint::CheckRedeposited(int fd) const {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISCHR(st.st_mode) || major(st.st_rdev) != 10 || minor(st.st_rdev) != 229) {
    return "the re-deposited fd is not /dev/fuse";
  }
  if (!options_.expected_connection) return "";
  auto conn = FuseConnectionOfFd(fd);
  if (!conn.ok()) return std::string(conn.status().message());
  if (!conn->has_value()) {
    return "this kernel does not tell which FUSE connection an fd is on (no fuse_connection in fdinfo), "
           "so a re-deposited fd cannot be verified";
  }
  if (**conn != *options_.expected_connection) {
    return absl::StrCat("the re-deposited fd is on FUSE connection ", **conn, ", not on this volume's (",
                        *options_.expected_connection, ")");
  }
  return "";
}

}  // namespace fusekeeper
