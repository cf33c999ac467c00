// RpcDispatcher: how every CSI RPC runs. gRPC calls a handler on one of its threads; we log the
// request (secrets redacted), hand the work to the loop with Post, and the loop-side code finishes
// the call through a Responder — now, or later when ring or pool work completes.
//
// Exactly-once finishing: a call is finished by whichever comes first of (a) its Responder,
// (b) the Responder being dropped unfinished (INTERNAL, rather than a hung caller), or
// (c) shutdown giving up on it after the grace period (UNAVAILABLE). Handlers never write into
// gRPC's response message themselves: they pass their own to Reply(), which copies it in under the
// call's lock only if the call is still open — so a call abandoned at shutdown (whose message gRPC
// may already have freed) is never touched again.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "agent/csi/redact.h"
#include "agent/loop/loop.h"
#include "glog/logging.h"
#include "google/protobuf/message.h"

namespace fusekeeper {

grpc::Status ToGrpcStatus(const absl::Status& status);

class RpcDispatcher;

// One RPC between Dispatch and its single Finish. Thread-safe.
class RpcCall {
 public:
  // `request_text` (redacted) is logged with the outcome; empty for quiet RPCs.
  RpcCall(RpcDispatcher* dispatcher, grpc::ServerUnaryReactor* reactor,
          google::protobuf::Message* response, const char* method, bool quiet,
          std::string request_text);
  // Finishes the call unless it already was; copies body (if any and status is OK) into the
  // response first. Returns false if the call had already been finished.
  bool Finish(const absl::Status& status, const google::protobuf::Message* body);

 private:
  RpcDispatcher* const dispatcher_;
  const char* const method_;
  const bool quiet_;
  const std::string request_text_;
  const absl::Time start_;
  absl::Mutex mu_;
  grpc::ServerUnaryReactor* reactor_ ABSL_GUARDED_BY(mu_);
  google::protobuf::Message* response_ ABSL_GUARDED_BY(mu_);
};

// Move-only handle the loop-side code uses to answer one RPC.
class Responder {
 public:
  explicit Responder(std::shared_ptr<RpcCall> call) : call_(std::move(call)) {}
  Responder(Responder&&) noexcept = default;
  Responder& operator=(Responder&&) = delete;
  Responder(const Responder&) = delete;
  ~Responder();

  // Any thread. OK with an empty response body.
  void Finish(const absl::Status& status) { Done(status, nullptr); }
  // Any thread. OK with this response body.
  void Reply(const google::protobuf::Message& body) { Done(absl::OkStatus(), &body); }

 private:
  void Done(const absl::Status& status, const google::protobuf::Message* body);
  std::shared_ptr<RpcCall> call_;
};

class RpcDispatcher {
 public:
  // Called (any thread) once per finished RPC: method, result code, latency. For metrics.
  using Observer = std::function<void(const char* method, absl::StatusCode code, absl::Duration latency)>;
  explicit RpcDispatcher(Loop& loop, Observer observer = nullptr) : observer_(std::move(observer)), loop_(loop) {}

  // Any thread. From now on new RPCs are refused with UNAVAILABLE; in-flight ones finish.
  void BeginDraining() { draining_.store(true, std::memory_order_release); }
  bool draining() const { return draining_.load(std::memory_order_acquire); }

  // Blocks (not on the loop thread) until no RPC is in flight or timeout passes; returns the
  // number still in flight.
  int WaitIdle(absl::Duration timeout);
  // Blocks until exactly n RPCs are in flight or timeout passes; returns whether they were.
  bool AwaitInFlightForTest(int n, absl::Duration timeout);
  // Any thread. Finishes every call still in flight with UNAVAILABLE; returns how many.
  int AbandonInFlight();

  // gRPC thread. For RPCs whose answer needs no volume state (constant facts, Probe): `answer`
  // fills the response and returns the status right here, on the gRPC thread, without a hop to
  // the loop. It must be cheap and must not block. Logged and observed like Dispatch.
  template <typename Req, typename Resp, typename Answer>
  grpc::ServerUnaryReactor* AnswerInline(grpc::CallbackServerContext* ctx, const char* method, const Req& req,
                                         Resp* resp, Answer answer) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    const absl::Time start = absl::Now();
    VLOG(2) << method << " " << RedactedDebugString(req);
    const absl::Status status =
        draining() ? absl::UnavailableError("fusekeeper is shutting down") : answer(resp);
    const absl::Duration took = absl::Now() - start;
    LOG_IF(WARNING, !status.ok()) << method << " -> " << absl::StatusCodeToString(status.code()) << ": "
                                  << status.message();
    if (observer_) observer_(method, status.code(), took);
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  }

  // gRPC thread. Every RPC is logged once, when it finishes, with its summary (RpcSummary),
  // result and latency (VLOG(1) also logs the whole redacted request when it starts). `quiet` RPCs (Probe, GetPluginInfo...:
  // polled by sidecars) log at VLOG(2) only. handler runs on the loop thread and must answer
  // through the Responder (or hand it on).
  template <typename Req>
  grpc::ServerUnaryReactor* Dispatch(grpc::CallbackServerContext* ctx, const char* method,
                                     bool quiet, const Req& req, google::protobuf::Message* resp,
                                     absl::AnyInvocable<void(Responder)> handler) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    // The one line per RPC carries only what names the RPC (RpcSummary: no copy, no
    // reflection); the whole (redacted) request is logged at VLOG(1).
    std::string request_text;
    if (quiet) {
      VLOG(2) << method << " " << RedactedDebugString(req);
    } else {
      request_text = RpcSummary(req);
      VLOG(1) << method << " " << RedactedDebugString(req) << " started";
    }
    auto call = std::make_shared<RpcCall>(this, reactor, resp, method, quiet, std::move(request_text));
    if (draining()) {
      call->Finish(absl::UnavailableError("fusekeeper is shutting down"), nullptr);
      return reactor;
    }
    Register(call);
    // If the loop refuses the post (it has stopped), the lambda is destroyed unrun; we still hold
    // the call, so the caller gets UNAVAILABLE instead of a hang.
    bool posted = loop_.Post([call, handler = std::move(handler)]() mutable {
      handler(Responder(call));
    });
    if (!posted) call->Finish(absl::UnavailableError("fusekeeper event loop has stopped"), nullptr);
    return reactor;
  }

 private:
  friend class RpcCall;
  const Observer observer_;
  void Register(const std::shared_ptr<RpcCall>& call);
  void Unregister(RpcCall* call);

  Loop& loop_;
  std::atomic<bool> draining_{false};
  absl::Mutex mu_;
  std::unordered_set<std::shared_ptr<RpcCall>> in_flight_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fusekeeper
