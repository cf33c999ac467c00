// HttpClient: HTTPS requests driven by the loop. libcurl's multi-socket API does the protocol
// work without blocking; every socket it wants watched is a POLL_ADD on the ring, every timeout
// it asks for is a loop timer. Requests have a total deadline; a slow or dead peer costs a timer,
// never a thread or a stall. Loop thread only.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

struct HttpRequest {
  std::string method = "GET";
  std::string url;
  std::vector<std::string> headers;  // "Name: value"
  std::string body;
  std::string ca_file;         // verify the peer with this CA bundle; empty: system CAs
  bool insecure = false;       // skip peer verification (explicit opt-in only)
  absl::Duration timeout = absl::Seconds(10);
  size_t max_response_bytes = 64 << 20;
};

struct HttpResult {
  long status = 0;
  std::string body;
};

class HttpClient {
 public:
  using Done = absl::AnyInvocable<void(absl::StatusOr<HttpResult>)>;
  static absl::StatusOr<std::unique_ptr<HttpClient>> Create(Loop& loop);
  // Destroy after the loop has stopped (cancels transfers; their callbacks do not run).
  ~HttpClient();

  // Transport failures (connect, TLS, timeout, oversize) are errors; any HTTP status is a result.
  void Send(HttpRequest request, Done done);
  size_t in_flight() const { return transfers_.size(); }

 private:
  struct Transfer;
  struct Watch;
  explicit HttpClient(Loop& loop);
  static int OnSocket(void* easy, int fd, int what, void* self, void* socketp);
  static int OnTimer(void* multi, long timeout_ms, void* self);
  void Arm(Watch* w);
  void Action(int fd, int events);
  void Reap();

  Loop& loop_;
  void* multi_ = nullptr;
  Timer timer_;  // the one timeout curl asks for
  std::map<void*, std::unique_ptr<Transfer>> transfers_;
  std::map<int, std::unique_ptr<Watch>> watches_;       // by fd
  std::vector<std::unique_ptr<Watch>> retired_;         // cancelled, completion pending
  bool in_action_ = false;
};

}  // namespace fusekeeper
