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
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "agent/base/crash_point.h"
#include "agent/base/status.h"
#include "agent/loop/lifetime.h"
#include "agent/fuse/fuse_mount.h"
#include "glog/logging.h"

#include "agent/fuse/handoff_endpoint_internal.h"

namespace fusekeeper {

HandoffEndpoint::Ptr HandoffEndpoint::Start(Loop& loop, UniqueFd listen_fd, UniqueFd fuse_fd, MountConfig config,
                                            HandoffOptions options, Events events) {
  Ptr e(new HandoffEndpoint(loop, std::move(fuse_fd), std::move(config), options, std::move(events)));
  e->AddListener(std::move(listen_fd), "");
  // Without a connection (an agent restart lost it) servers wait, unless the serving one
  // re-deposits it (the policy starts awaiting that).
  if (e->fuse_fd_) e->abort_watch_.Watch(e->fuse_fd_.get());
  return e;
}

HandoffEndpoint::HandoffEndpoint(Loop& loop, UniqueFd fuse_fd, MountConfig config, HandoffOptions options,
                                 Events events)
    : loop_(loop),
      pending_(loop),
      fuse_fd_(std::move(fuse_fd)),
      config_(std::move(config)),
      options_(options),
      events_(std::move(events)),
      abort_watch_(loop, pending_, [this] { OnAborted(); }),
      standby_fallback_(loop),
      policy_(fuse_fd_.valid()) {}

HandoffEndpoint::~HandoffEndpoint() = default;

void HandoffEndpoint::Retire::operator()(HandoffEndpoint* e) const {
  Loop& loop = e->loop_;
  // Stop and the ring's cancels belong on the loop thread (until the loop has finished).
  if (!loop.IsLoopThread() && !loop.finished() && loop.Post([e] { Retire()(e); })) return;
  e->Stop();
  e->pending_.Retire([e] { delete e; });
}

void HandoffEndpoint::ReleaseLater(std::unique_ptr<Connection> doomed) {
  if (doomed) DeleteLater(loop_, std::move(doomed));
}

void HandoffEndpoint::AddListener(UniqueFd listen_fd, const std::string& tag) {
  if (policy_.stopped()) return;
  RemoveListener(tag);
  auto l = std::make_unique<HandoffListener>(
      loop_, pending_, std::move(listen_fd), tag, "volume " + config_.volume_id,
      [this, tag](UniqueFd fd) {
        if (!policy_.stopped()) OnAccepted(std::move(fd), tag);
      });
  HandoffListener* raw = l.get();
  raw->set_on_ended([this, raw] { ListenerEnded(raw); });
  listeners_.push_back(std::move(l));
  raw->Start();
  if (!tag.empty()) LOG(INFO) << "volume " << config_.volume_id << ": also listening for its server on " << tag;
}

void HandoffEndpoint::ListenerEnded(HandoffListener* l) {
  for (auto it = listeners_.begin(); it != listeners_.end(); ++it) {
    if (it->get() == l) {
      DeleteLater(loop_, std::move(*it));  // (its own callback is the one running)
      listeners_.erase(it);
      return;
    }
  }
}

void HandoffEndpoint::RemoveListener(const std::string& tag) {
  for (auto& l : listeners_) {
    if (l->tag() == tag) l->Close();
  }
  for (auto it = standby_.begin(); it != standby_.end();) {
    if ((*it)->tag == tag) {
      LOG(INFO) << "volume " << config_.volume_id << ": " << (*it)->Peer() << " on standby from " << tag
                << " is dropped: its listener closed";
      ReleaseLater(std::move(*it));
      it = standby_.erase(it);
    } else {
      ++it;
    }
  }
}

bool HandoffEndpoint::HasServerFrom(const std::string& tag) const {
  if (policy_.serving() && serving_connection_ != nullptr && serving_connection_->tag == tag) return true;
  for (const auto& c : standby_) {
    if (c->tag == tag) return true;
  }
  return false;
}

void HandoffEndpoint::ToStandby(Connection* c) {
  constexpr size_t kMaxStandby = 4;
  if (standby_.size() >= kMaxStandby) {
    ReleaseLater(std::move(standby_.front()));
    standby_.pop_front();
  }
  const std::string tag = c->tag;
  standby_.push_back(TakeConnection(c));
  if (events_.on_standby) events_.on_standby(tag);
  RelieveDrainer();
}

void HandoffEndpoint::MarkDraining(Connection* c) {
  if (c != serving_connection_ || c->draining || policy_.stopped()) return;
  c->draining = true;
  LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer()
            << " was asked to stop and serves on until a successor waits to take over";
  if (events_.on_draining) events_.on_draining();
  RelieveDrainer();
}

void HandoffEndpoint::RelieveDrainer() {
  Connection* c = serving_connection_;
  if (c == nullptr || !c->draining || c->relieved || !c->peer.open() || standby_.empty()) return;
  c->relieved = true;
  ++relieved_;
  // A few bytes on a socket with room: MSG_DONTWAIT never waits. Lost, the server stops at its
  // own deadline instead.
  if (!c->peer.SendNow(EncodeStopRequest())) {
    LOG(WARNING) << "volume " << config_.volume_id << ": asking draining " << c->Peer() << " to stop: "
                 << strerror(errno) << "; it stops at its own deadline";
    return;
  }
  LOG(INFO) << "volume " << config_.volume_id << ": draining " << c->Peer() << " is asked to stop: "
            << standby_.back()->Peer() << " from " << standby_.back()->tag << " waits to take over";
}

void HandoffEndpoint::PromoteStandby() {
  // Awaiting a re-deposit (after an agent restart), standbys wait for it or its fallback timer.
  while (!standby_.empty() && policy_.MayPromoteStandby()) {
    std::unique_ptr<Connection> c = std::move(standby_.front());
    standby_.pop_front();
    // One that hung up while it waited is dropped (nothing reads from it while it waits).
    if (!c->peer.WaitsQuietly()) {
      LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer() << " on standby hung up";
      ReleaseLater(std::move(c));
      continue;
    }
    LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer() << " on standby from " << c->tag
              << " takes over";
    Connection* raw = c.get();
    connections_in_flight_.push_back(std::move(c));
    return Admit(raw);
  }
}

void HandoffEndpoint::Stop() {
  if (policy_.stopped()) return;
  policy_.Stop();
  standby_fallback_.Cancel();
  for (auto& l : listeners_) l->Close();
  for (auto& c : standby_) ReleaseLater(std::move(c));
  standby_.clear();
  abort_watch_.Stop();
  for (auto& c : parked_) ReleaseLater(std::move(c));
  parked_.clear();
  for (auto& c : connections_in_flight_) c->peer.Cancel();
}

void HandoffEndpoint::OnAccepted(UniqueFd fd, const std::string& tag) {
  connections_in_flight_.push_back(std::make_unique<Connection>(loop_, pending_, std::move(fd)));
  Connection* c = connections_in_flight_.back().get();
  c->tag = tag;
  ++connections_;
  auto cred = c->peer.Credentials();
  if (!cred.ok()) return Finish(c, cred.status(), std::nullopt);
  c->peer_pid = cred->pid;
  c->peer_uid = cred->uid;
  if (options_.peer_uid && cred->uid != 0 && cred->uid != *options_.peer_uid) {
    return SendOffer(c, /*refuse=*/true,
                     absl::StrCat("uid ", cred->uid, " may not serve volume ", config_.volume_id,
                                  " (expected uid ", *options_.peer_uid, ")"));
  }
  Route(c);
}

namespace {

// A server that goes with an answer of ours unread in its socket (a passthrough close's, say)
// resets the connection, and the ring's receive reports that before what the server sent last,
// which is still queued: its last word (the final HandoffReply), if it said one.
std::optional<HandoffReply> LastWordAfterReset(HandoffPeer& peer) {
  std::optional<HandoffReply> last;
  for (const std::string& msg : peer.QueuedAfterReset()) {
    if (auto backing = DecodeBackingRequest(msg); !backing.ok() || backing->has_value()) continue;
    if (auto reply = DecodeHandoffReply(msg); reply.ok() && reply->notice.empty() && !reply->draining) last = *reply;
  }
  return last;
}

// What a serving server's final HandoffReply says of its end.
absl::Status StoppedBecause(const HandoffReply& last) {
  return last.ok ? absl::UnavailableError("the FUSE server stopped serving")
                 : absl::UnavailableError(absl::StrCat("the FUSE server stopped: ", last.error));
}

}  // namespace

void HandoffEndpoint::Route(Connection* c) {
  const std::optional<std::string> serving_tag =
      serving_connection_ != nullptr ? std::optional<std::string>(serving_connection_->tag) : std::nullopt;
  switch (policy_.RouteArrival(c->tag, serving_tag)) {
    case HandoffPolicy::Route::kStandby:
      // A server pod's server while another pod's serves (a roll): it waits to take over.
      LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer() << " from " << c->tag
                << " waits on standby until the serving server stops";
      return ToStandby(c);
    case HandoffPolicy::Route::kRefuse:
      if (serving_connection_->peer.HungUp()) {
        // The serving server is gone, but the ring has not told of its end yet (its receive was
        // re-armed after its last message and comes in a later turn than this arrival): this one
        // is routed once that end has been handled, not refused as a second server.
        LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer()
                  << " arrived before the end of the server it succeeds was handled; it waits for it";
        awaiting_end_.push_back(TakeConnection(c));
        return;
      }
      return SendOffer(c, /*refuse=*/true, absl::StrCat("volume ", config_.volume_id, " is already being served"));
    case HandoffPolicy::Route::kAdmit:
      return Admit(c);
  }
}

void HandoffEndpoint::Admit(Connection* c) {
  switch (policy_.Admit()) {
    case HandoffPolicy::Admission::kAwaitRedeposit:
      return AwaitRedeposit(c);
    case HandoffPolicy::Admission::kPark:
      // The kept connection is dead; this server gets the fresh one the owner is making.
      parked_.push_back(TakeConnection(c));
      if (events_.on_fresh_requested) events_.on_fresh_requested();
      return;
    case HandoffPolicy::Admission::kOffer:
      return SendOffer(c, /*refuse=*/false, "");
  }
}

void HandoffEndpoint::OnAborted() {
  if (policy_.stopped()) return;
  policy_.Aborted();
  serving_connection_ = nullptr;  // its server's end, when it reports it, is no news
  if (abort_expected_) {
    LOG(INFO) << "volume " << config_.volume_id << ": the agent aborted its old FUSE connection";
  } else {
    LOG(WARNING) << "volume " << config_.volume_id << ": its FUSE connection was aborted";
  }
  if (events_.on_connection_aborted) events_.on_connection_aborted();
}

void HandoffEndpoint::ReplaceConnection(UniqueFd fuse_fd) {
  if (policy_.stopped()) return;
  abort_watch_.Stop();  // (its poll completes later, quietly)
  fuse_fd_ = std::move(fuse_fd);
  policy_.Replaced();
  abort_expected_ = false;
  serving_connection_ = nullptr;
  init_record_.clear();
  relay_state_.Reset();  // it describes the connection that is gone
  backing_ids_.clear();  // the kernel closes them with that connection
  backing_ids_complete_ = true;
  ++connection_generation_;
  std::vector<std::unique_ptr<Connection>> waiting = std::move(parked_);
  parked_.clear();
  for (auto& c : waiting) {
    Connection* raw = c.get();
    connections_in_flight_.push_back(std::move(c));
    SendOffer(raw, /*refuse=*/false, "");
  }
  abort_watch_.Watch(fuse_fd_.get());
  if (waiting.empty()) PromoteStandby();
}

void HandoffEndpoint::SendOffer(Connection* c, bool refuse, std::string why) {
  c->refused = refuse;
  c->live = !refuse && policy_.OfferLive();
  std::string out;
  if (refuse) {
    out = EncodeHandoffRefusal(why);
  } else {
    MountConfig m = config_;
    if (c->live) {
      m.live = true;
      m.init = init_record_;
      m.relay_state = relay_state_.valid();
    }
    // A server pod's server may drain when asked to stop: the agent makes its successor.
    if (!c->tag.empty() && options_.drain_wait > absl::ZeroDuration()) {
      m.drain_ms = absl::ToInt64Milliseconds(options_.drain_wait);
    }
    out = EncodeMountConfig(m);
  }
  std::vector<int> fds;
  if (!refuse) {
    // A relay (fkserve launch) reads the connection non-blocking; the flag belongs to the open
    // file, which this dup shares. Whoever gets it next expects a blocking /dev/fuse, as libfuse
    // does (a non-blocking read would end its loop).
    if (const int fl = fcntl(fuse_fd_.get(), F_GETFL); fl >= 0 && (fl & O_NONBLOCK)) {
      fcntl(fuse_fd_.get(), F_SETFL, fl & ~O_NONBLOCK);
    }
    fds = {fuse_fd_.get(), c->live ? relay_state_.get() : -1};
  }
  c->peer.Send(std::move(out), std::move(fds), [this, c, why](int32_t res) { OnSent(c, res, why); });
}

void HandoffEndpoint::OnSent(Connection* c, int32_t res, const std::string& why) {
  if (res < 0) return Finish(c, ErrnoStatus(-res, "sending the handoff to the server"), std::nullopt);
  if (c->refused) return Finish(c, absl::PermissionDeniedError(why), std::nullopt);
  if (policy_.stopped()) return Finish(c, absl::CancelledError("handoff endpoint stopped"), std::nullopt);
  c->peer.Receive(options_.reply_timeout, [this, c](HandoffPeer::Received got) { OnReply(c, std::move(got)); });
}

void HandoffEndpoint::OnReply(Connection* c, HandoffPeer::Received got) {
  // Any fds but a relay state the reply announces are closed (they go out of scope here).
  const int32_t res = got.res;
  if (res == -ECANCELED) {
    if (policy_.stopped()) return Finish(c, absl::CancelledError("handoff endpoint stopped"), std::nullopt);
    return Finish(c, absl::DeadlineExceededError(absl::StrCat(
                         "the server took the fd but did not answer within ",
                         absl::FormatDuration(options_.reply_timeout))),
                  std::nullopt);
  }
  if (res < 0) return Finish(c, ErrnoStatus(-res, "reading the server's reply"), std::nullopt);
  if (res == 0) {
    return Finish(c, absl::UnavailableError("the server closed the connection without answering"), std::nullopt);
  }
  if (got.truncated) return Finish(c, absl::InvalidArgumentError("the server's reply was too large"), std::nullopt);
  auto reply = DecodeHandoffReply(got.message);
  if (!reply.ok()) return Finish(c, reply.status(), std::nullopt);
  if (!reply->ok && reply->fresh && c->live && !policy_.stopped()) {
    // Keep the connection: the server waits on it for a fresh connection's config.
    LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer()
              << " cannot adopt the live connection and asks for a fresh one";
    parked_.push_back(TakeConnection(c));
    if (events_.on_fresh_requested) events_.on_fresh_requested();
    return;
  }
  if (!reply->ok) {
    return Finish(c, absl::FailedPreconditionError(absl::StrCat("the server refused: ", reply->error)), std::nullopt);
  }
  // The state is the serving server's: one that keeps none (or attaches something else)
  // leaves none for its successor.
  relay_state_.Reset();
  if (reply->relay_state) {
    KeepRelayState(c, got.fds.size() == 1 && !got.other_control ? std::move(got.fds[0]) : UniqueFd());
  }
  // Backing ids a predecessor left for a successor that keeps no state: nobody can name them.
  if (!relay_state_.valid() && !backing_ids_.empty()) {
    if (KnowIdentity(c).ok()) CloseBackingIds(*c->identity, "its successor keeps no table of them");
  }
  Finish(c, absl::OkStatus(), *reply);
}

std::unique_ptr<HandoffEndpoint::Connection> HandoffEndpoint::TakeConnection(Connection* c) {
  for (auto it = connections_in_flight_.begin(); it != connections_in_flight_.end(); ++it) {
    if (it->get() == c) {
      std::unique_ptr<Connection> taken = std::move(*it);
      connections_in_flight_.erase(it);
      return taken;
    }
  }
  return nullptr;
}

void HandoffEndpoint::WatchServer(Connection* c) {
  c->peer.Receive(std::nullopt, [this, c](HandoffPeer::Received got) { OnServerMessage(c, std::move(got)); });
}

void HandoffEndpoint::OnServerMessage(Connection* c, HandoffPeer::Received got) {
  const int32_t res = got.res;
  if (res > 0) {
    auto backing = DecodeBackingRequest(got.message);
    if (backing.ok() && backing->has_value() && !policy_.stopped()) {
      OnBackingRequest(c, **backing, std::move(got.fds));
      return WatchServer(c);
    }
  }
  absl::Status why;
  std::optional<HandoffReply> last_word;
  if (res == -ECONNRESET) last_word = LastWordAfterReset(c->peer);
  if (last_word) {
    why = StoppedBecause(*last_word);
  } else if (res == -ECANCELED) {
    why = absl::CancelledError("the agent stopped watching the server");
  } else if (res == 0 || res == -ECONNRESET) {  // (a reset: it went with an answer of ours unread)
    why = absl::UnavailableError("the FUSE server closed its connection (it exited or was killed)");
  } else if (res < 0) {
    why = absl::UnavailableError(absl::StrCat("the FUSE server's connection failed (", strerror(-res),
                                              "; it exited or was killed)"));
  } else {
    auto reply = DecodeHandoffReply(got.message);
    if (reply.ok() && reply->ok && reply->draining && !policy_.stopped()) {
      // Asked to stop, it serves on until a successor waits: not the end either.
      MarkDraining(c);
      return WatchServer(c);
    }
    if (reply.ok() && !reply->notice.empty() && !policy_.stopped()) {
      // Not the end: pass it on and keep watching.
      if (c == serving_connection_) {
        LOG(WARNING) << "volume " << config_.volume_id << ": its FUSE server reports: " << reply->notice;
        if (events_.on_server_notice) events_.on_server_notice(*reply);
      }
      return WatchServer(c);
    }
    why = reply.ok() ? StoppedBecause(*reply) : reply.status();
  }
  ServerEnded(c, why);
}

void HandoffEndpoint::ServerEnded(Connection* c, const absl::Status& why) {
  if (c == serving_connection_) ServerLeftBackingIds(c);
  c->alive.End();  // a registration still on its way is closed when it comes back
  c->peer.Close();
  const bool current = c == serving_connection_;
  if (current) serving_connection_ = nullptr;
  std::unique_ptr<Connection> doomed = TakeConnection(c);
  if (!current) {
    // A server of an earlier connection (aborted and replaced) reporting its end after its
    // successor took over: nothing about the current server.
    LOG(INFO) << "volume " << config_.volume_id << ": an earlier server's handoff connection ended ("
              << why.message() << ")";
  } else if (!policy_.stopped()) {
    policy_.ServerGone();
    LOG(WARNING) << "volume " << config_.volume_id << ": " << why.message();
    if (events_.on_server_gone) events_.on_server_gone(why);
    PromoteStandby();
  }
  if (current) RouteAwaitingEnd();
  ReleaseLater(std::move(doomed));
}

void HandoffEndpoint::RouteAwaitingEnd() {
  std::vector<std::unique_ptr<Connection>> waiting = std::move(awaiting_end_);
  awaiting_end_.clear();
  if (policy_.stopped()) return;  // they close with their sockets
  for (auto& c : waiting) {
    Connection* raw = c.get();
    connections_in_flight_.push_back(std::move(c));
    Route(raw);
  }
}

void HandoffEndpoint::Finish(Connection* c, absl::Status status, std::optional<HandoffReply> reply) {
  if (status.ok() && !policy_.stopped()) {
    policy_.Served();
    if (c->live) ++adoptions_;
    if (!c->live && !reply->init.empty()) init_record_ = reply->init;
    LOG(INFO) << "volume " << config_.volume_id << " handed to " << c->Peer() << " ("
              << reply->server << ")";
    if (events_.on_served) events_.on_served(*reply, c->peer_pid);
    serving_connection_ = c;
    WatchServer(c);  // the connection stays open while the server serves
    return;
  }
  c->peer.Close();
  std::unique_ptr<Connection> doomed = TakeConnection(c);
  if (!status.ok()) {
    LOG(WARNING) << "handoff of volume " << config_.volume_id << " to " << c->Peer()
                 << " failed: " << status;
    if (events_.on_connection_error) events_.on_connection_error(status);
  }
  ReleaseLater(std::move(doomed));
}

}  // namespace fusekeeper
