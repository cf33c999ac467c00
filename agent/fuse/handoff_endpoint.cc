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

namespace fusekeeper {

// Everything one connection's ring operations point at, kept alive until they all complete.
struct HandoffEndpoint::Connection {
  UniqueFd fd;
  pid_t peer_pid = 0;  // 0: the peer is in another pid namespace (a pod without hostPID)
  uid_t peer_uid = 0;
  // Who the peer is, for logs: its pid when this namespace can see it, its uid always.
  std::string Peer() const {
    return peer_pid > 0 ? absl::StrCat("server pid ", peer_pid, " (uid ", peer_uid, ")")
                        : absl::StrCat("server uid ", peer_uid, " (pid not visible: another pid namespace)");
  }
  std::string out;
  iovec out_iov{};
  msghdr out_msg{};
  FdControl out_control;
  std::string in;
  iovec in_iov{};
  msghdr in_msg{};
  FdControl in_control;
  Completion send;
  Completion recv;
  TimerId timer = 0;
  bool live = false;  // the offer was of a connection an earlier server initialised
  bool refused = false;
  bool finished = false;
  std::string tag;  // the listener it came through (AddListener); empty: the main one
  bool draining = false;  // serving, asked to stop, waiting for a successor (MountConfig::drain_ms)
  bool relieved = false;  // told to stop
};

struct HandoffEndpoint::Listener {
  UniqueFd fd;
  Completion accept;
  std::string tag;
  bool closed = false;
  bool in_flight = false;
};

namespace {

// Whether `entry` is a temporary socket name (".<name>.<pid>.tmp"); `name` empty: of any socket.
// Sets *pid.
bool IsTempSocketName(absl::string_view entry, absl::string_view name, pid_t* pid) {
  if (!absl::ConsumePrefix(&entry, ".") || !absl::ConsumeSuffix(&entry, ".tmp")) return false;
  const size_t dot = entry.rfind('.');
  if (dot == absl::string_view::npos || dot == 0) return false;
  if (!name.empty() && entry.substr(0, dot) != name) return false;
  const absl::string_view digits = entry.substr(dot + 1);
  if (digits.empty() || digits.size() > 10) return false;
  uint64_t n = 0;
  for (char ch : digits) {
    if (ch < '0' || ch > '9') return false;
    n = n * 10 + static_cast<uint64_t>(ch - '0');
  }
  *pid = static_cast<pid_t>(n);
  return true;
}

// Removes the temporary socket names in `dir_fd` that `doomed` picks (sockets only: a file of
// another kind under such a name is not ours). Returns how many.
template <typename Doomed>
int RemoveTempSocketsBlocking(int dir_fd, Doomed doomed) {
  // dir_fd may be an O_PATH descriptor: a readable one of the same directory lists it.
  const int list_fd = openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (list_fd < 0) return 0;
  DIR* d = fdopendir(list_fd);
  if (d == nullptr) {
    close(list_fd);
    return 0;
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    pid_t pid = 0;
    if ((e->d_type == DT_SOCK || e->d_type == DT_UNKNOWN) && doomed(e->d_name, &pid)) names.push_back(e->d_name);
  }
  closedir(d);
  int removed = 0;
  for (const std::string& n : names) {
    struct stat st;
    if (fstatat(dir_fd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISSOCK(st.st_mode) &&
        unlinkat(dir_fd, n.c_str(), 0) == 0) {
      LOG(INFO) << "removed " << n << ", a handoff socket's temporary name an earlier agent left";
      ++removed;
    }
  }
  return removed;
}

}  // namespace

std::string HandoffEndpoint::TempSocketName(const std::string& name, pid_t pid) {
  return absl::StrCat(".", name, ".", pid, ".tmp");
}

void HandoffEndpoint::RemoveSocketBlocking(int dir_fd, const std::string& name) {
  unlinkat(dir_fd, name.c_str(), 0);
  RemoveTempSocketsBlocking(dir_fd, [&name](const char* entry, pid_t* pid) {
    return IsTempSocketName(entry, name, pid);
  });
}

int HandoffEndpoint::RemoveStaleTempSocketsBlocking(int dir_fd) {
  const pid_t me = getpid();
  return RemoveTempSocketsBlocking(dir_fd, [me](const char* entry, pid_t* pid) {
    return IsTempSocketName(entry, "", pid) && *pid != me;
  });
}

absl::StatusOr<UniqueFd> HandoffEndpoint::ListenBlocking(int dir_fd, const std::string& name,
                                                        uid_t owner_uid, gid_t owner_gid) {
  if (name.empty() || name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("handoff socket name '", name, "' is not a plain name"));
  }
  UniqueFd sock(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!sock) return ErrnoStatus(errno, "socket(AF_UNIX, SOCK_SEQPACKET)");
  // Made under a temporary name, given to its owner and listening before it is renamed into
  // place: a server waiting for it (inotify) never meets it half made (refused, or not listening).
  const std::string tmp = TempSocketName(name, getpid());
  const std::string via = absl::StrCat("/proc/self/fd/", dir_fd, "/", tmp);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (via.size() >= sizeof(addr.sun_path)) return absl::InvalidArgumentError("handoff socket name too long");
  std::memcpy(addr.sun_path, via.data(), via.size());
  // A socket file left by an earlier agent is ours to replace; anything else is refused.
  struct stat st;
  for (const std::string& n : {name, tmp}) {
    if (fstatat(dir_fd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "handoff socket path ", n, " exists and is not a socket; refusing to replace it"));
    }
  }
  // Ours, and any an earlier agent killed between its bind and its rename left (unrenamed, they
  // would stay forever: nothing else knows their pid).
  RemoveTempSocketsBlocking(dir_fd, [&name](const char* entry, pid_t* pid) {
    return IsTempSocketName(entry, name, pid);
  });
  // Created 0600 from its first instant (fchmod on a socket fd does not change the file).
  const mode_t old = umask(0177);
  int r = bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  umask(old);
  if (r != 0) return ErrnoStatus(errno, "bind handoff socket", name);
  auto fail = [&](absl::Status s) {
    unlinkat(dir_fd, tmp.c_str(), 0);
    return s;
  };
  if (fchownat(dir_fd, tmp.c_str(), owner_uid, owner_gid, AT_SYMLINK_NOFOLLOW) != 0) {
    return fail(ErrnoStatus(errno, "chown handoff socket", name));
  }
  if (listen(sock.get(), 8) != 0) return fail(ErrnoStatus(errno, "listen on handoff socket", name));
  CrashPoint("handoff-socket-unnamed");
  if (renameat(dir_fd, tmp.c_str(), dir_fd, name.c_str()) != 0) {
    return fail(ErrnoStatus(errno, "renaming the handoff socket into place", name));
  }
  return sock;
}

std::shared_ptr<HandoffEndpoint> HandoffEndpoint::Start(Loop& loop, UniqueFd listen_fd,
                                                        UniqueFd fuse_fd, MountConfig config,
                                                        HandoffOptions options, Events events) {
  std::shared_ptr<HandoffEndpoint> e(
      new HandoffEndpoint(loop, std::move(fuse_fd), std::move(config), options, std::move(events)));
  e->AddListener(std::move(listen_fd), "");
  // Without a connection (an agent restart lost it) servers wait, unless the serving one
  // re-deposits it (the policy starts awaiting that).
  if (e->fuse_fd_) e->ArmAbortWatch();
  return e;
}

HandoffEndpoint::HandoffEndpoint(Loop& loop, UniqueFd fuse_fd, MountConfig config, HandoffOptions options,
                                 Events events)
    : loop_(loop),
      fuse_fd_(std::move(fuse_fd)),
      config_(std::move(config)),
      options_(options),
      events_(std::move(events)),
      policy_(fuse_fd_.valid()) {}

HandoffEndpoint::~HandoffEndpoint() = default;

void HandoffEndpoint::Arm(io_uring_sqe* sqe, Completion* completion) {
  if (in_flight_++ == 0) keep_alive_ = shared_from_this();
  loop_.Arm(sqe, completion);
}

void HandoffEndpoint::Completed() { --in_flight_; }

void HandoffEndpoint::ReleaseLater(std::unique_ptr<Connection> doomed) {
  struct Grave {
    std::unique_ptr<Connection> connection;
    std::shared_ptr<HandoffEndpoint> self;
  };
  auto* grave = new Grave{std::move(doomed), in_flight_ == 0 ? std::move(keep_alive_) : nullptr};
  // If the loop has already finished (process exit), the grave is left as it is.
  loop_.Post([grave] { delete grave; });
}

void HandoffEndpoint::AddListener(UniqueFd listen_fd, const std::string& tag) {
  if (policy_.stopped()) return;
  RemoveListener(tag);
  auto l = std::make_unique<Listener>();
  l->fd = std::move(listen_fd);
  l->tag = tag;
  Listener* raw = l.get();
  listeners_.push_back(std::move(l));
  raw->accept.callback = [this, raw](int32_t res, bool) {
    Completed();
    raw->in_flight = false;
    if (res >= 0) {
      if (policy_.stopped() || raw->closed) {
        close(res);
      } else {
        OnAccepted(res, raw->tag);
      }
    } else if (res != -ECANCELED && res != -EINTR) {
      LOG(WARNING) << "handoff accept for volume " << config_.volume_id
                   << (raw->tag.empty() ? "" : " on " + raw->tag) << ": " << strerror(-res);
    }
    if (!policy_.stopped() && !raw->closed && res != -ECANCELED && loop_.running()) {
      ArmAccept(raw);
    } else if (raw->closed || policy_.stopped()) {
      // Freed after this callback (its own completion) has returned.
      loop_.Post([self = shared_from_this(), raw] {
        for (auto it = self->listeners_.begin(); it != self->listeners_.end(); ++it) {
          if (it->get() == raw && !raw->in_flight) {
            self->listeners_.erase(it);
            return;
          }
        }
      });
    }
    if (in_flight_ == 0) ReleaseLater(nullptr);
  };
  ArmAccept(raw);
  if (!tag.empty()) LOG(INFO) << "volume " << config_.volume_id << ": also listening for its server on " << tag;
}

void HandoffEndpoint::ArmAccept(Listener* l) {
  l->in_flight = true;
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_accept(sqe, l->fd.get(), nullptr, nullptr, SOCK_CLOEXEC);
  Arm(sqe, &l->accept);
}

void HandoffEndpoint::CloseListener(Listener* l) {
  l->closed = true;
  if (l->in_flight) loop_.Cancel(&l->accept);
  l->fd.Reset();
}

void HandoffEndpoint::RemoveListener(const std::string& tag) {
  for (auto& l : listeners_) {
    if (l->tag == tag && !l->closed) CloseListener(l.get());
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
  if (c == nullptr || !c->draining || c->relieved || !c->fd.valid() || standby_.empty()) return;
  c->relieved = true;
  ++relieved_;
  // A few bytes on a socket with room: MSG_DONTWAIT never waits. Lost, the server stops at its
  // own deadline instead.
  const std::string stop = EncodeStopRequest();
  if (send(c->fd.get(), stop.data(), stop.size(), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
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
    pollfd p{c->fd.get(), POLLIN | POLLRDHUP, 0};
    if (poll(&p, 1, 0) < 0 || (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLIN))) {
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
  if (standby_fallback_ != 0) loop_.CancelTimer(standby_fallback_);
  standby_fallback_ = 0;
  for (auto& l : listeners_) {
    if (!l->closed) CloseListener(l.get());
  }
  for (auto& c : standby_) ReleaseLater(std::move(c));
  standby_.clear();
  if (abort_watch_ != nullptr) loop_.Cancel(&abort_watch_->completion);
  abort_watch_ = nullptr;
  for (auto& c : parked_) ReleaseLater(std::move(c));
  parked_.clear();
  for (auto& c : connections_in_flight_) {
    loop_.Cancel(&c->send);
    loop_.Cancel(&c->recv);
  }
}

void HandoffEndpoint::OnAccepted(int fd, const std::string& tag) {
  connections_in_flight_.push_back(std::make_unique<Connection>());
  Connection* c = connections_in_flight_.back().get();
  c->fd.Reset(fd);
  c->tag = tag;
  ++connections_;
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return Finish(c, ErrnoStatus(errno, "SO_PEERCRED on handoff connection"), std::nullopt);
  }
  c->peer_pid = cred.pid;
  c->peer_uid = cred.uid;
  if (options_.peer_uid && cred.uid != 0 && cred.uid != *options_.peer_uid) {
    return SendOffer(c, /*refuse=*/true,
                     absl::StrCat("uid ", cred.uid, " may not serve volume ", config_.volume_id,
                                  " (expected uid ", *options_.peer_uid, ")"));
  }
  Route(c);
}

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

void HandoffEndpoint::ArmAbortWatch() {
  // Watches live in a pool of completions with stable addresses: a watch on a replaced
  // connection can still be completing while the new one is armed. A watch's callback is set
  // once, when it is created: it may re-arm its own watch, and must not be replaced while it runs.
  Watch* watch = nullptr;
  for (auto& w : watches_) {
    if (!w.in_flight) watch = &w;
  }
  if (watch == nullptr) {
    watch = &watches_.emplace_back();
    watch->completion.callback = [this, watch](int32_t res, bool) {
      Completed();
      watch->in_flight = false;
      if (watch == abort_watch_) {
        abort_watch_ = nullptr;
        if (res > 0 && (res & (POLLERR | POLLHUP)) && !policy_.stopped()) {
          policy_.Aborted();
          serving_connection_ = nullptr;  // its server's end, when it reports it, is no news
          if (abort_expected_) {
            LOG(INFO) << "volume " << config_.volume_id << ": the agent aborted its old FUSE connection";
          } else {
            LOG(WARNING) << "volume " << config_.volume_id << ": its FUSE connection was aborted";
          }
          if (events_.on_connection_aborted) events_.on_connection_aborted();
        } else if (res >= 0 && !policy_.stopped()) {
          ArmAbortWatch();  // woken without an error: keep watching
        }
      }
      if (in_flight_ == 0) ReleaseLater(nullptr);
    };
  }
  watch->in_flight = true;
  abort_watch_ = watch;
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_poll_add(sqe, fuse_fd_.get(), POLLERR);
  Arm(sqe, &watch->completion);
}

void HandoffEndpoint::ReplaceConnection(UniqueFd fuse_fd) {
  if (policy_.stopped()) return;
  if (abort_watch_ != nullptr) {
    loop_.Cancel(&abort_watch_->completion);  // completes later as a non-current watch
    abort_watch_ = nullptr;
  }
  fuse_fd_ = std::move(fuse_fd);
  policy_.Replaced();
  abort_expected_ = false;
  serving_connection_ = nullptr;
  init_record_.clear();
  relay_state_.Reset();  // it describes the connection that is gone
  std::vector<std::unique_ptr<Connection>> waiting = std::move(parked_);
  parked_.clear();
  for (auto& c : waiting) {
    Connection* raw = c.get();
    connections_in_flight_.push_back(std::move(c));
    SendOffer(raw, /*refuse=*/false, "");
  }
  ArmAbortWatch();
  if (waiting.empty()) PromoteStandby();
}

void HandoffEndpoint::SendOffer(Connection* c, bool refuse, std::string why) {
  c->refused = refuse;
  c->live = !refuse && policy_.OfferLive();
  if (refuse) {
    c->out = EncodeHandoffRefusal(why);
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
    c->out = EncodeMountConfig(m);
  }
  c->out_iov = {c->out.data(), c->out.size()};
  c->out_msg.msg_iov = &c->out_iov;
  c->out_msg.msg_iovlen = 1;
  if (!refuse) {
    // A relay (fkserve launch) reads the connection non-blocking; the flag belongs to the open
    // file, which this dup shares. Whoever gets it next expects a blocking /dev/fuse, as libfuse
    // does (a non-blocking read would end its loop).
    if (const int fl = fcntl(fuse_fd_.get(), F_GETFL); fl >= 0 && (fl & O_NONBLOCK)) {
      fcntl(fuse_fd_.get(), F_SETFL, fl & ~O_NONBLOCK);
    }
    const int fds[2] = {fuse_fd_.get(), c->live ? relay_state_.get() : -1};
    AttachFds(&c->out_msg, &c->out_control, fds, 2);
  }
  c->send.callback = [this, c, why](int32_t res, bool) {
    Completed();
    if (res < 0) return Finish(c, ErrnoStatus(-res, "sending the handoff to the server"), std::nullopt);
    if (c->refused) return Finish(c, absl::PermissionDeniedError(why), std::nullopt);
    if (policy_.stopped()) return Finish(c, absl::CancelledError("handoff endpoint stopped"), std::nullopt);
    AwaitReply(c);
  };
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_sendmsg(sqe, c->fd.get(), &c->out_msg, MSG_NOSIGNAL);
  Arm(sqe, &c->send);
}

void HandoffEndpoint::AwaitReply(Connection* c) {
  PrepareReceive(c);
  c->recv.callback = [this, c](int32_t res, bool) {
    Completed();
    loop_.CancelTimer(c->timer);
    // Any fds but a relay state the reply announces are closed (they go out of scope here).
    std::vector<UniqueFd> fds;
    bool other_control = false;
    if (res > 0) fds = TakeReceivedFds(c->in_msg, &other_control);
    if (res == -ECANCELED) {
      if (policy_.stopped()) return Finish(c, absl::CancelledError("handoff endpoint stopped"), std::nullopt);
      return Finish(c, absl::DeadlineExceededError(absl::StrCat(
                           "the server took the fd but did not answer within ",
                           absl::FormatDuration(options_.reply_timeout))),
                    std::nullopt);
    }
    if (res < 0) return Finish(c, ErrnoStatus(-res, "reading the server's reply"), std::nullopt);
    if (res == 0) {
      return Finish(c, absl::UnavailableError("the server closed the connection without answering"),
                    std::nullopt);
    }
    if (c->in_msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
      return Finish(c, absl::InvalidArgumentError("the server's reply was too large"), std::nullopt);
    }
    auto reply = DecodeHandoffReply(absl::string_view(c->in.data(), static_cast<size_t>(res)));
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
      return Finish(c, absl::FailedPreconditionError(absl::StrCat("the server refused: ", reply->error)),
                    std::nullopt);
    }
    // The state is the serving server's: one that keeps none (or attaches something else)
    // leaves none for its successor.
    relay_state_.Reset();
    if (reply->relay_state) KeepRelayState(c, fds.size() == 1 && !other_control ? std::move(fds[0]) : UniqueFd());
    Finish(c, absl::OkStatus(), *reply);
  };
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_recvmsg(sqe, c->fd.get(), &c->in_msg, MSG_CMSG_CLOEXEC);
  Arm(sqe, &c->recv);
  // Only fires while the receive is in flight, so the endpoint is alive (kept by keep_alive_).
  c->timer = loop_.AddTimer(absl::ToChronoNanoseconds(options_.reply_timeout),
                            [this, c] { loop_.Cancel(&c->recv); });
}

void HandoffEndpoint::AwaitRedeposit(Connection* c) {
  PrepareReceive(c);
  c->recv.callback = [this, c](int32_t res, bool) {
    Completed();
    loop_.CancelTimer(c->timer);
    std::vector<UniqueFd> fds;
    bool other_control = false;
    if (res > 0) fds = TakeReceivedFds(c->in_msg, &other_control);
    if (policy_.stopped()) return Finish(c, absl::CancelledError("handoff endpoint stopped"), std::nullopt);
    if (res == -ECANCELED) {
      if (!policy_.awaiting_redeposit()) return Route(c);  // re-deposited meanwhile (by another server)
      if (!c->tag.empty()) {
        // A server pod's server with nothing to re-deposit, after an agent restart: another pod's
        // server (the one a roll replaces) may be serving and about to re-deposit. It waits on
        // standby; if nobody re-deposits within standby_redeposit_wait, it gets a fresh connection.
        LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer() << " from " << c->tag
                  << " has nothing to re-deposit: it waits on standby for the serving server to re-deposit or stop";
        ToStandby(c);
        if (standby_fallback_ == 0) {
          standby_fallback_ = loop_.AddTimer(absl::ToChronoNanoseconds(options_.standby_redeposit_wait), [this] {
            standby_fallback_ = 0;
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
      return;
    }
    if (res < 0) return Finish(c, ErrnoStatus(-res, "reading from the server"), std::nullopt);
    if (res == 0) return Finish(c, absl::UnavailableError("the server closed the connection"), std::nullopt);
    auto reply = DecodeHandoffReply(absl::string_view(c->in.data(), static_cast<size_t>(res)));
    if (!reply.ok()) return Finish(c, reply.status(), std::nullopt);
    if (!reply->ok || !reply->redeposit) {
      return Finish(c, absl::InvalidArgumentError("the server spoke first without re-depositing a connection"),
                    std::nullopt);
    }
    std::string why;
    if (fds.size() != (reply->relay_state ? 2u : 1u) || other_control) {
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
    if (reply->relay_state) KeepRelayState(c, std::move(fds[1]));
    policy_.Redeposited();
    ++redeposits_;
    init_record_ = reply->init;
    LOG(INFO) << "volume " << config_.volume_id << ": " << c->Peer()
              << " re-deposited its live FUSE connection";
    ArmAbortWatch();
    Finish(c, absl::OkStatus(), *reply);  // the same server goes on serving: not an adoption
    // It was draining when the agent went away: it still waits for its successor.
    if (reply->draining) MarkDraining(c);
  };
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_recvmsg(sqe, c->fd.get(), &c->in_msg, MSG_CMSG_CLOEXEC);
  Arm(sqe, &c->recv);
  c->timer = loop_.AddTimer(absl::ToChronoNanoseconds(options_.redeposit_wait),
                            [this, c] { loop_.Cancel(&c->recv); });
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

void HandoffEndpoint::PrepareReceive(Connection* c) {
  c->in.assign(kMaxHandoffMessageBytes + 1, '\0');
  c->in_iov = {c->in.data(), c->in.size()};
  c->in_msg = {};
  c->in_msg.msg_iov = &c->in_iov;
  c->in_msg.msg_iovlen = 1;
  c->in_msg.msg_control = c->in_control.bytes;
  c->in_msg.msg_controllen = sizeof(c->in_control.bytes);
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
  c->recv.callback = [this, c](int32_t res, bool) {
    Completed();
    if (res > 0) {
      bool other_control;
      TakeReceivedFds(c->in_msg, &other_control);
    }
    absl::Status why;
    if (res == -ECANCELED) {
      why = absl::CancelledError("the agent stopped watching the server");
    } else if (res <= 0) {
      why = absl::UnavailableError("the FUSE server closed its connection (it exited or was killed)");
    } else {
      auto reply = DecodeHandoffReply(absl::string_view(c->in.data(), static_cast<size_t>(res)));
      if (reply.ok() && reply->ok && reply->draining && !policy_.stopped()) {
        // Asked to stop, it serves on until a successor waits: not the end either.
        MarkDraining(c);
        ArmServerReceive(c);
        return;
      }
      if (reply.ok() && !reply->notice.empty() && !policy_.stopped()) {
        // Not the end: pass it on and keep watching.
        if (c == serving_connection_) {
          LOG(WARNING) << "volume " << config_.volume_id << ": its FUSE server reports: " << reply->notice;
          if (events_.on_server_notice) events_.on_server_notice(*reply);
        }
        ArmServerReceive(c);  // (the callback stays: it is the one running)
        return;
      }
      why = !reply.ok()  ? reply.status()
            : reply->ok  ? absl::UnavailableError("the FUSE server stopped serving")
                         : absl::UnavailableError(absl::StrCat("the FUSE server stopped: ", reply->error));
    }
    c->fd.Reset();
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
    ReleaseLater(std::move(doomed));
  };
  ArmServerReceive(c);
}

void HandoffEndpoint::ArmServerReceive(Connection* c) {
  PrepareReceive(c);
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_recvmsg(sqe, c->fd.get(), &c->in_msg, MSG_CMSG_CLOEXEC);
  Arm(sqe, &c->recv);
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
  c->fd.Reset();
  std::unique_ptr<Connection> doomed = TakeConnection(c);
  if (!status.ok()) {
    LOG(WARNING) << "handoff of volume " << config_.volume_id << " to " << c->Peer()
                 << " failed: " << status;
    if (events_.on_connection_error) events_.on_connection_error(status);
  }
  ReleaseLater(std::move(doomed));
}

}  // namespace fusekeeper
