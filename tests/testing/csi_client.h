// Test helpers for talking CSI to an agent over its Unix socket.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "proto/csi.grpc.pb.h"
#include "proto/csi.pb.h"

#include <chrono>

// Fails the test (with the RPC expression and its message) unless the gRPC status is OK.
#define ASSERT_RPC_OK(expr)                                      \
  do {                                                           \
    grpc::Status _s = (expr);                                    \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s.error_message(); \
  } while (0)

namespace fusekeeper {

// A channel that retries fast while the agent is starting (gRPC's default backoff starts at 1 s).
inline std::shared_ptr<grpc::Channel> DialUnixSocket(const std::string& socket_path) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 10);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 10);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 100);
  // Own subchannels: a channel to a restarted agent must not inherit the dead one's backoff.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel("unix:" + socket_path, grpc::InsecureChannelCredentials(), args);
}

// Waits (bounded by `deadline`) until the agent answers Probe with ready (saved volume state
// reconciled). Returns whether it did.
inline bool WaitForReadyAgent(const std::shared_ptr<grpc::Channel>& channel,
                              std::chrono::steady_clock::time_point deadline) {
  auto identity = csi::v1::Identity::NewStub(channel);
  while (std::chrono::steady_clock::now() < deadline) {
    csi::v1::ProbeResponse p;
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + (deadline - std::chrono::steady_clock::now()));
    if (identity->Probe(&c, {}, &p).ok() && p.ready().value()) return true;
  }
  return false;
}

// A file-system volume capability, single-node writer: what kubelet sends for a mount volume.
inline csi::v1::VolumeCapability MountCapability() {
  csi::v1::VolumeCapability cap;
  cap.mutable_mount();
  cap.mutable_access_mode()->set_mode(csi::v1::VolumeCapability::AccessMode::SINGLE_NODE_WRITER);
  return cap;
}

}  // namespace fusekeeper
