#include "agent/csi/rpc.h"

#include <utility>
#include <vector>

namespace fusekeeper {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // absl canonical codes and gRPC codes share their numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

RpcCall::RpcCall(RpcDispatcher* dispatcher, grpc::ServerUnaryReactor* reactor,
                 google::protobuf::Message* response, const char* method, bool quiet,
                 std::string request_text)
    : dispatcher_(dispatcher),
      method_(method),
      quiet_(quiet),
      request_text_(std::move(request_text)),
      start_(absl::Now()),
      reactor_(reactor),
      response_(response) {}

bool RpcCall::Finish(const absl::Status& status, const google::protobuf::Message* body) {
  absl::Duration took;
  {
    absl::MutexLock lock(&mu_);
    if (reactor_ == nullptr) return false;
    if (status.ok() && body != nullptr) response_->CopyFrom(*body);
    took = absl::Now() - start_;
    if (dispatcher_->observer_) dispatcher_->observer_(method_, status.code(), took);
    std::exchange(reactor_, nullptr)->Finish(ToGrpcStatus(status));
    response_ = nullptr;
  }
  // Logged once the answer is on its way: the caller does not wait for the log write.
  const int64_t micros = absl::ToInt64Microseconds(took);
  if (!status.ok()) {
    LOG(WARNING) << method_ << " " << request_text_ << " -> " << absl::StatusCodeToString(status.code()) << ": "
                 << status.message() << " (" << micros << "us)";
  } else if (quiet_) {
    VLOG(2) << method_ << " -> OK (" << micros << "us)";
  } else {
    LOG(INFO) << method_ << " " << request_text_ << " -> OK (" << micros << "us)";
  }
  dispatcher_->Unregister(this);
  return true;
}

Responder::~Responder() {
  if (call_ != nullptr) {
    call_->Finish(absl::InternalError("the RPC was dropped without a result (agent bug)"), nullptr);
  }
}

void Responder::Done(const absl::Status& status, const google::protobuf::Message* body) {
  if (call_ == nullptr) return;
  std::exchange(call_, nullptr)->Finish(status, body);
}

void RpcDispatcher::Register(const std::shared_ptr<RpcCall>& call) {
  absl::MutexLock lock(&mu_);
  in_flight_.insert(call);
}

void RpcDispatcher::Unregister(RpcCall* call) {
  absl::MutexLock lock(&mu_);
  // Aliasing shared_ptr with a no-op deleter: lets us look the call up by raw pointer.
  in_flight_.erase(std::shared_ptr<RpcCall>(std::shared_ptr<RpcCall>(), call));
}

int RpcDispatcher::WaitIdle(absl::Duration timeout) {
  CHECK(!loop_.IsLoopThread()) << "WaitIdle blocks; call it off the loop thread";
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_.empty(); };
  mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
  return static_cast<int>(in_flight_.size());
}

bool RpcDispatcher::AwaitInFlightForTest(int n, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return static_cast<int>(in_flight_.size()) == n;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&reached), timeout);
}

int RpcDispatcher::AbandonInFlight() {
  std::vector<std::shared_ptr<RpcCall>> calls;
  {
    absl::MutexLock lock(&mu_);
    calls.assign(in_flight_.begin(), in_flight_.end());
  }
  int abandoned = 0;
  for (auto& call : calls) {
    if (call->Finish(absl::UnavailableError(
                         "fusekeeper shut down before this operation finished; it may still "
                         "complete: retry to learn its outcome"),
                     nullptr)) {
      ++abandoned;
    }
  }
  return abandoned;
}

}  // namespace fusekeeper
