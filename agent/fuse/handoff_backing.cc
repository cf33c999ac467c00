// HandoffEndpoint: FUSE passthrough brokered for the serving server (backing_broker.h,
// handoff_protocol.h). Only the server serving the volume may ask; each open answers with a
// backing id of the volume's connection or a refusal that says why. The ids are the
// connection's: what a server leaves registered when it stops is kept for its successor when the
// server deposited a table of them (fkserve's backing_table.h: the kernel takes one backing file
// per inode, so a successor must name the ones files still open use), and closed otherwise.
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
  if (!c->peer.SendNow(msg)) {
    LOG(WARNING) << "volume " << config_.volume_id << ": cannot answer " << c->Peer() << "'s passthrough request: "
                 << strerror(errno);
  }
}

absl::Status HandoffEndpoint::KnowIdentity(Connection* c) {
  if (c->identity) return absl::OkStatus();
  auto who = PeerIdentity(c->peer.fd());
  if (!who.ok()) return who.status();
  c->identity = *who;
  return absl::OkStatus();
}

void HandoffEndpoint::RefuseBacking(Connection* c, uint64_t id, const std::string& why) {
  ++backing_refused_;
  LOG(WARNING) << "volume " << config_.volume_id << ": passthrough request of " << c->Peer() << " refused: " << why;
  ReplyBacking(c, BackingReply{id, 0, why});
  // (Not for what is as configured: a connection whose first server did not ask for passthrough,
  // or an agent that brokers none.)
  if (!IsFinalBackingRefusal(why) && !c->backing_refusal_reported && c == serving_connection_ && events_.on_backing_refused) {
    c->backing_refusal_reported = true;
    events_.on_backing_refused(why);
  }
}

void HandoffEndpoint::OnBackingRequest(Connection* c, const BackingRequest& req, std::vector<UniqueFd> fds) {
  auto refuse = [&](const std::string& why) { RefuseBacking(c, req.id, why); };
  if (options_.broker == nullptr) return refuse(kRefusalNoBroker);
  if (c != serving_connection_) return refuse("only the server serving the volume may register backing files");
  if (!fuse_fd_) return refuse("the agent holds no copy of the volume's connection yet (it restarted; re-deposit first)");
  if (req.open && fds.size() != 1) return refuse("a backing_open request carries exactly one file descriptor");
  if (!req.open && !fds.empty()) return refuse("a backing_close request carries no file descriptor");
  if (c->backing_in_flight >= options_.max_backing_in_flight) {
    return refuse(absl::StrCat("more than ", options_.max_backing_in_flight, " passthrough requests in flight"));
  }
  if (req.open && static_cast<int>(backing_ids_.size()) >= options_.max_backing_ids) {
    return refuse(absl::StrCat("this volume's connection holds ", backing_ids_.size(),
                               " backing files already (at most ", options_.max_backing_ids, ")"));
  }
  // (After a re-deposit the ids registered before are unknown here: the kernel says whether an id
  // is one; either way it is one of this connection's.)
  if (!req.open && backing_ids_complete_ && backing_ids_.count(req.backing_id) == 0) {
    return refuse(absl::StrCat("backing id ", req.backing_id, " is not one this volume's servers registered"));
  }
  if (absl::Status s = KnowIdentity(c); !s.ok()) return refuse(std::string(s.message()));
  ++c->backing_in_flight;
  if (req.open) {
    options_.broker->Open(
        fuse_fd_.get(), std::move(fds[0]), *c->identity,
        [this, hold = pending_.HoldOne(), c, alive = c->alive.token(), id = req.id, who = *c->identity,
         generation = connection_generation_](absl::StatusOr<int32_t> r) {
          if (!alive.alive() || generation != connection_generation_) {
            // The server (or the connection) went while its file was being registered: nobody
            // will name or close it (an earlier connection's closes with that connection).
            if (r.ok() && fuse_fd_ && generation == connection_generation_) options_.broker->Close(fuse_fd_.get(), *r, who);
            if (alive.alive()) {
              --c->backing_in_flight;
              ReplyBacking(c, BackingReply{id, 0, "the volume's connection was replaced while the file was registered"});
            }
            return;
          }
          --c->backing_in_flight;
          if (!r.ok()) return RefuseBacking(c, id, std::string(r.status().message()));
          backing_ids_.insert(*r);
          ++backing_opened_;
          if (c->backing_opened++ == 0) {
            LOG(INFO) << "volume " << config_.volume_id << ": passthrough: " << c->Peer() << " registered its first "
                      << "backing file (the kernel reads and writes it directly, as the server's user)";
          }
          ReplyBacking(c, BackingReply{id, *r, ""});
        });
    return;
  }
  backing_ids_.erase(req.backing_id);
  options_.broker->Close(fuse_fd_.get(), req.backing_id, *c->identity,
                         [this, hold = pending_.HoldOne(), c, alive = c->alive.token(), id = req.id](absl::Status s) {
                           if (!alive.alive()) return;
                           --c->backing_in_flight;
                           ReplyBacking(c, BackingReply{id, 0, s.ok() ? "" : std::string(s.message())});
                         });
}

void HandoffEndpoint::ServerLeftBackingIds(Connection* c) {
  if (backing_ids_.empty()) return;
  if (relay_state_.valid()) {
    LOG(INFO) << "volume " << config_.volume_id << ": keeping the " << backing_ids_.size()
              << " backing file(s) registered on its connection for the next server (the state its stopped "
                 "server deposited names them)";
    return;
  }
  // (A server that only shared its predecessors' ids never asked anything: who it was is still on
  // its socket, which keeps the peer's credentials after the peer is gone.)
  if (absl::Status s = KnowIdentity(c); !s.ok()) {
    LOG(WARNING) << "volume " << config_.volume_id << ": cannot close the backing files registered on its connection ("
                 << s << "); they stay registered until the connection ends";
    return;
  }
  CloseBackingIds(*c->identity, "its stopped server left them registered and deposited no table of them");
}

void HandoffEndpoint::CloseBackingIds(const ServerIdentity& who, const char* why) {
  if (backing_ids_.empty() || options_.broker == nullptr || !fuse_fd_) return;
  LOG(INFO) << "volume " << config_.volume_id << ": closing the " << backing_ids_.size()
            << " backing file(s) registered on its connection: " << why;
  for (int32_t id : backing_ids_) options_.broker->Close(fuse_fd_.get(), id, who);
  backing_ids_.clear();
}

}  // namespace fusekeeper
