// RpcDispatcher: how every CSI RPC runs. gRPC calls a handler on one of its threads; we log the
// request (secrets redacted), hand the work to the loop with Post, and the loop-side code finishes
// the call through a Responder — now, or later when ring or pool work completes. A Responder
// finishes its RPC exactly once: if it is dropped unfinished, the RPC fails with INTERNAL rather
// than hanging the caller.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "agent/csi/redact.h"
#include "agent/loop/loop.h"
#include "glog/logging.h"

namespace fusekeeper {

grpc::Status ToGrpcStatus(const absl::Status& status);

class Responder {
 public:
  Responder(grpc::ServerUnaryReactor* reactor, const char* method, bool quiet);
  Responder(Responder&& other) noexcept;
  Responder& operator=(Responder&&) = delete;
  Responder(const Responder&) = delete;
  ~Responder();

  // Any thread. Finishes the RPC; the response message must be filled in before.
  void Finish(const absl::Status& status);

 private:
  grpc::ServerUnaryReactor* reactor_;
  const char* method_;
  bool quiet_;
  absl::Time start_;
};

class RpcDispatcher {
 public:
  explicit RpcDispatcher(Loop& loop) : loop_(loop) {}

  // Any thread. From now on new RPCs are refused with UNAVAILABLE; in-flight ones finish.
  void BeginDraining() { draining_.store(true, std::memory_order_release); }
  bool draining() const { return draining_.load(std::memory_order_acquire); }

  // gRPC thread. `quiet` RPCs (Probe, GetPluginInfo...: polled by sidecars) log at VLOG(2) only.
  // handler runs on the loop thread and must finish the Responder (or hand it on).
  template <typename Req>
  grpc::ServerUnaryReactor* Dispatch(grpc::CallbackServerContext* ctx, const char* method,
                                     bool quiet, const Req& req,
                                     absl::AnyInvocable<void(Responder)> handler) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    if (quiet) {
      VLOG(2) << method << " " << RedactedDebugString(req);
    } else {
      LOG(INFO) << method << " " << RedactedDebugString(req);
    }
    Responder responder(reactor, method, quiet);
    if (draining()) {
      responder.Finish(absl::UnavailableError("fusekeeper is shutting down"));
      return reactor;
    }
    // If the loop refuses the post (it has stopped), the lambda is destroyed unrun and we still
    // hold the Responder, so the caller gets UNAVAILABLE instead of a hang.
    auto shared = std::make_shared<Responder>(std::move(responder));
    bool posted = loop_.Post([shared, handler = std::move(handler)]() mutable {
      handler(std::move(*shared));
    });
    if (!posted) shared->Finish(absl::UnavailableError("fusekeeper event loop has stopped"));
    return reactor;
  }

 private:
  Loop& loop_;
  std::atomic<bool> draining_{false};
};

}  // namespace fusekeeper
