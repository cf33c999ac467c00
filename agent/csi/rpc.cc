#include "agent/csi/rpc.h"

#include <utility>

namespace fusekeeper {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // absl canonical codes and gRPC codes share their numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

Responder::Responder(grpc::ServerUnaryReactor* reactor, const char* method, bool quiet)
    : reactor_(reactor), method_(method), quiet_(quiet), start_(absl::Now()) {}

Responder::Responder(Responder&& other) noexcept
    : reactor_(std::exchange(other.reactor_, nullptr)),
      method_(other.method_),
      quiet_(other.quiet_),
      start_(other.start_) {}

Responder::~Responder() {
  if (reactor_ != nullptr) {
    Finish(absl::InternalError(std::string(method_) + " was dropped without a result (agent bug)"));
  }
}

void Responder::Finish(const absl::Status& status) {
  if (reactor_ == nullptr) return;
  const int64_t micros = absl::ToInt64Microseconds(absl::Now() - start_);
  if (!status.ok()) {
    LOG(WARNING) << method_ << " -> " << absl::StatusCodeToString(status.code()) << ": "
                 << status.message() << " (" << micros << "us)";
  } else if (quiet_) {
    VLOG(2) << method_ << " -> OK (" << micros << "us)";
  } else {
    LOG(INFO) << method_ << " -> OK (" << micros << "us)";
  }
  std::exchange(reactor_, nullptr)->Finish(ToGrpcStatus(status));
}

}  // namespace fusekeeper
