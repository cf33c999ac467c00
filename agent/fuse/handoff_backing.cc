// HandoffEndpoint: FUSE passthrough brokered for the serving server (backing_broker.h,
// handoff_protocol.h). Only the server serving the volume may ask; each open answers with a
// backing id of the volume's connection or a refusal that says why, and what a server leaves
// registered when it stops is closed.
#include <fcntl.h>
#include <sys/socket.h>

#include "absl/strings/str_cat.h"
#include "agent/fuse/handoff_endpoint_internal.h"
#include "glog/logging.h"

namespace fusekeeper {

void HandoffEndpoint::ReplyBacking(Connection* c, const BackingReply& reply) {
  const std::string msg = EncodeBackingReply(reply);
  // Small, and the server reads its connection all the time: never waits (a server that lets its
  // socket fill up gets no more answers, and its opens fail its own way).
  if (send(c->fd.get(), msg.data(), msg.size(), MSG_DONTWAIT | MSG_NOSIGNAL) != static_cast<ssize_t>(msg.size())) {
    LOG(WARNING) << "volume " << config_.volume_id << ": cannot answer " << c->Peer() << "'s passthrough request: "
                 << strerror(errno);
  }
}

void HandoffEndpoint::OnBackingRequest(Connection* c, const BackingRequest& req, std::vector<UniqueFd> fds) {
  auto refuse = [&](const std::string& why) {
    ++backing_refused_;
    LOG(WARNING) << "volume " << config_.volume_id << ": passthrough request of " << c->Peer() << " refused: " << why;
    ReplyBacking(c, BackingReply{req.id, 0, why});
  };
  if (options_.broker == nullptr) return refuse("this agent brokers no passthrough");
  if (c != serving_connection_) return refuse("only the server serving the volume may register backing files");
  if (!fuse_fd_) return refuse("the agent holds no copy of the volume's connection yet (it restarted; re-deposit first)");
  if (req.open && fds.size() != 1) return refuse("a backing_open request carries exactly one file descriptor");
  if (!req.open && !fds.empty()) return refuse("a backing_close request carries no file descriptor");
  if (c->backing_in_flight >= options_.max_backing_in_flight) {
    return refuse(absl::StrCat("more than ", options_.max_backing_in_flight, " passthrough requests in flight"));
  }
  if (req.open && static_cast<int>(c->backing_ids.size()) >= options_.max_backing_ids) {
    return refuse(absl::StrCat("this server holds ", c->backing_ids.size(), " backing files already (at most ",
                               options_.max_backing_ids, ")"));
  }
  if (!req.open && c->backing_ids.count(req.backing_id) == 0) {
    return refuse(absl::StrCat("backing id ", req.backing_id, " is not one this server registered"));
  }
  if (!c->identity) {
    auto who = PeerIdentity(c->fd.get());
    if (!who.ok()) return refuse(std::string(who.status().message()));
    c->identity = *who;
  }
  ++c->backing_in_flight;
  auto self = shared_from_this();
  if (req.open) {
    options_.broker->Open(
        fuse_fd_.get(), std::move(fds[0]), *c->identity,
        [this, self, c, alive = c->alive.token(), id = req.id, who = *c->identity](absl::StatusOr<int32_t> r) {
          if (!alive.alive()) {
            // The server went while its file was being registered: nobody will close it.
            if (r.ok() && fuse_fd_) options_.broker->Close(fuse_fd_.get(), *r, who);
            return;
          }
          --c->backing_in_flight;
          if (!r.ok()) {
            ++backing_refused_;
            LOG(WARNING) << "volume " << config_.volume_id << ": backing file of " << c->Peer() << " refused: " << r.status();
            return ReplyBacking(c, BackingReply{id, 0, std::string(r.status().message())});
          }
          c->backing_ids.insert(*r);
          ++backing_opened_;
          if (c->backing_opened++ == 0) {
            LOG(INFO) << "volume " << config_.volume_id << ": passthrough: " << c->Peer() << " registered its first "
                      << "backing file (the kernel reads and writes it directly, as the server's user)";
          }
          ReplyBacking(c, BackingReply{id, *r, ""});
        });
    return;
  }
  c->backing_ids.erase(req.backing_id);
  options_.broker->Close(fuse_fd_.get(), req.backing_id, *c->identity,
                         [this, self, c, alive = c->alive.token(), id = req.id](absl::Status s) {
                           if (!alive.alive()) return;
                           --c->backing_in_flight;
                           ReplyBacking(c, BackingReply{id, 0, s.ok() ? "" : std::string(s.message())});
                         });
}

void HandoffEndpoint::ReleaseBackingIds(Connection* c) {
  if (c->backing_ids.empty() || options_.broker == nullptr || !c->identity || !fuse_fd_) return;
  LOG(INFO) << "volume " << config_.volume_id << ": closing the " << c->backing_ids.size()
            << " backing file(s) its stopped server left registered";
  for (int32_t id : c->backing_ids) {
    options_.broker->Close(fuse_fd_.get(), id, *c->identity);
  }
  c->backing_ids.clear();
}

}  // namespace fusekeeper
