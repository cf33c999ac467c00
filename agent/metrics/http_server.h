// HttpServer: a tiny HTTP/1.0-style server on the loop's ring, for /metrics and /healthz. Each
// connection sends one GET request (read under a deadline) and gets one response, then is
// closed. Accept, receive and send all go through the ring; handlers run on the loop thread.
// Anything else (other methods, oversized or slow requests) gets an error status or is closed.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/base/unique_fd.h"
#include "agent/loop/accept_backoff.h"
#include "agent/loop/loop.h"

namespace fusekeeper {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

class HttpServer {
 public:
  using Handler = std::function<HttpResponse()>;

  // Listens on `address` ("host:port", ":port" for all addresses; port 0 picks one).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(Loop& loop, const std::string& address,
                                                           std::map<std::string, Handler> handlers,
                                                           absl::Duration request_timeout = absl::Seconds(5));
  // Destroy after the loop has stopped.
  ~HttpServer();
  int port() const { return port_; }

 private:
  struct Connection;
  HttpServer(Loop& loop, UniqueFd listen_fd, std::map<std::string, Handler> handlers, absl::Duration timeout);
  void ArmAccept();
  void OnAccepted(int fd);
  void Respond(Connection* c, const HttpResponse& r);
  void Close(Connection* c);

  Loop& loop_;
  UniqueFd listen_fd_;
  std::map<std::string, Handler> handlers_;
  const absl::Duration timeout_;
  int port_ = 0;
  Completion accept_;
  AcceptBackoff backoff_;  // out of fds: the next accept waits (accept_backoff.h)
  std::map<Connection*, std::unique_ptr<Connection>> connections_;
};

}  // namespace fusekeeper
