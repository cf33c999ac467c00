#include "agent/metrics/http_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "agent/base/status.h"
#include "agent/loop/lifetime.h"
#include "agent/loop/timer.h"
#include "glog/logging.h"

namespace fusekeeper {

struct HttpServer::Connection {
  explicit Connection(Loop& loop) : deadline(loop) {}
  UniqueFd fd;
  std::string in = std::string(4096, '\0');
  size_t used = 0;
  std::string out;
  size_t sent = 0;
  Completion recv, send;
  Timer deadline;  // for the request
  bool closing = false;
  int in_flight = 0;
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(Loop& loop, const std::string& address,
                                                              std::map<std::string, Handler> handlers,
                                                              absl::Duration timeout) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  const std::string host = address.substr(0, colon);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (host.empty() || host == "0.0.0.0") {
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
  } else if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address host '", host, "' is not an IPv4 address"));
  }
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return ErrnoStatus(errno, "socket");
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(errno, "bind metrics address", address);
  }
  if (listen(fd.get(), 64) != 0) return ErrnoStatus(errno, "listen", address);
  socklen_t len = sizeof(addr);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  std::unique_ptr<HttpServer> s(new HttpServer(loop, std::move(fd), std::move(handlers), timeout));
  s->port_ = ntohs(addr.sin_port);
  s->ArmAccept();
  return s;
}

HttpServer::HttpServer(Loop& loop, UniqueFd listen_fd, std::map<std::string, Handler> handlers, absl::Duration timeout)
    : loop_(loop), listen_fd_(std::move(listen_fd)), handlers_(std::move(handlers)), timeout_(timeout) {
  accept_.callback = [this](int32_t res, bool) {
    const bool was_pause = backoff_.paused();
    backoff_.Ended();
    if (!was_pause && res >= 0) {
      backoff_.Resumed("metrics server");
      OnAccepted(res);
    }
    if (res == -ECANCELED || !loop_.running()) return;
    if (!was_pause && AcceptBackoff::OutOfResources(res)) return backoff_.Pause(loop_, &accept_, "metrics server", res);
    if (!was_pause && res < 0 && res != -EINTR && res != -ECONNABORTED) {
      LOG(WARNING) << "metrics server accept: " << strerror(-res);
    }
    ArmAccept();
  };
}

HttpServer::~HttpServer() = default;

void HttpServer::ArmAccept() {
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_accept(sqe, listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
  loop_.Arm(sqe, &accept_);
}

void HttpServer::OnAccepted(int fd) {
  auto owned = std::make_unique<Connection>(loop_);
  Connection* c = owned.get();
  c->fd.Reset(fd);
  connections_[c] = std::move(owned);
  c->recv.callback = [this, c](int32_t res, bool) {
    --c->in_flight;
    if (c->closing || res <= 0) return Close(c);
    c->used += static_cast<size_t>(res);
    const absl::string_view got(c->in.data(), c->used);
    if (got.find("\r\n\r\n") == absl::string_view::npos && got.find("\n\n") == absl::string_view::npos) {
      if (c->used == c->in.size()) return Respond(c, {431, "text/plain", "request too large\n"});
      io_uring_sqe* sqe = loop_.GetSqe();
      io_uring_prep_recv(sqe, c->fd.get(), c->in.data() + c->used, c->in.size() - c->used, 0);
      ++c->in_flight;
      return loop_.Arm(sqe, &c->recv);
    }
    c->deadline.Cancel();
    if (!absl::StartsWith(got, "GET ")) return Respond(c, {405, "text/plain", "only GET is served\n"});
    const size_t end = got.find(' ', 4);
    std::string path(got.substr(4, end == absl::string_view::npos ? absl::string_view::npos : end - 4));
    path = path.substr(0, path.find('?'));
    auto h = handlers_.find(path);
    if (h == handlers_.end()) return Respond(c, {404, "text/plain", "not found\n"});
    Respond(c, h->second());
  };
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_recv(sqe, fd, c->in.data(), c->in.size(), 0);
  ++c->in_flight;
  loop_.Arm(sqe, &c->recv);
  c->deadline.Arm(absl::ToChronoNanoseconds(timeout_), [this, c] {
    c->closing = true;
    loop_.Cancel(&c->recv);
  });
}

void HttpServer::Respond(Connection* c, const HttpResponse& r) {
  const char* reason = r.status == 200 ? "OK" : r.status == 404 ? "Not Found" : r.status == 503 ? "Service Unavailable" : "Error";
  c->out = absl::StrCat("HTTP/1.1 ", r.status, " ", reason, "\r\nContent-Type: ", r.content_type,
                        "\r\nContent-Length: ", r.body.size(), "\r\nConnection: close\r\n\r\n", r.body);
  c->send.callback = [this, c](int32_t res, bool) {
    --c->in_flight;
    if (res <= 0) return Close(c);
    c->sent += static_cast<size_t>(res);
    if (c->sent >= c->out.size()) return Close(c);
    io_uring_sqe* sqe = loop_.GetSqe();
    io_uring_prep_send(sqe, c->fd.get(), c->out.data() + c->sent, c->out.size() - c->sent, MSG_NOSIGNAL);
    ++c->in_flight;
    loop_.Arm(sqe, &c->send);
  };
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_send(sqe, c->fd.get(), c->out.data(), c->out.size(), MSG_NOSIGNAL);
  ++c->in_flight;
  loop_.Arm(sqe, &c->send);
}

void HttpServer::Close(Connection* c) {
  c->deadline.Cancel();
  if (c->in_flight > 0) return;  // the last completion closes it
  // Not destroyed inside its own callback: after the current one returns.
  auto it = connections_.find(c);
  if (it == connections_.end()) return;
  DeleteLater(loop_, std::move(it->second));
  connections_.erase(it);
}

}  // namespace fusekeeper
