// CSI Identity service: who we are, what we offer, and whether we are ready.
#pragma once

#include <functional>
#include <map>
#include <string>

#include "agent/csi/rpc.h"
#include "agent/loop/loop.h"
#include "proto/csi.grpc.pb.h"

namespace fusekeeper {

struct IdentityOptions {
  std::string driver_name;
  std::string vendor_version;
  std::map<std::string, std::string> manifest;
  // Loop thread: further readiness (e.g. volume state reconciled). Null: always ready.
  std::function<bool()> ready;
};

// Handlers run on gRPC threads and finish from the loop thread (see RpcDispatcher).
class IdentityService final : public csi::v1::Identity::CallbackService {
 public:
  IdentityService(Loop& loop, RpcDispatcher& dispatcher, IdentityOptions options);

  grpc::ServerUnaryReactor* GetPluginInfo(grpc::CallbackServerContext* ctx,
                                          const csi::v1::GetPluginInfoRequest* req,
                                          csi::v1::GetPluginInfoResponse* resp) override;
  grpc::ServerUnaryReactor* GetPluginCapabilities(grpc::CallbackServerContext* ctx,
                                                  const csi::v1::GetPluginCapabilitiesRequest* req,
                                                  csi::v1::GetPluginCapabilitiesResponse* resp) override;
  // Ready only while the loop runs and is not shutting down: answered from the loop thread, so
  // a wedged loop makes Probe time out and the livenessprobe sidecar restarts us.
  grpc::ServerUnaryReactor* Probe(grpc::CallbackServerContext* ctx, const csi::v1::ProbeRequest* req,
                                  csi::v1::ProbeResponse* resp) override;

 private:
  Loop& loop_;
  RpcDispatcher& dispatcher_;
  const IdentityOptions options_;
};

}  // namespace fusekeeper
