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
  // Any thread, cheap: further readiness (e.g. volume state reconciled). Null: always ready.
  std::function<bool()> ready;
  // Probe answers not ready while the loop has been busy in one go for this long: a wedged loop.
  absl::Duration loop_stall_limit = absl::Seconds(5);
};

// Every answer here is a constant or a few atomic reads: answered on the gRPC thread
// (RpcDispatcher::AnswerInline), with no hop to the loop.
class IdentityService final : public csi::v1::Identity::CallbackService {
 public:
  IdentityService(Loop& loop, RpcDispatcher& dispatcher, IdentityOptions options);

  grpc::ServerUnaryReactor* GetPluginInfo(grpc::CallbackServerContext* ctx,
                                          const csi::v1::GetPluginInfoRequest* req,
                                          csi::v1::GetPluginInfoResponse* resp) override;
  grpc::ServerUnaryReactor* GetPluginCapabilities(grpc::CallbackServerContext* ctx,
                                                  const csi::v1::GetPluginCapabilitiesRequest* req,
                                                  csi::v1::GetPluginCapabilitiesResponse* resp) override;
  // Ready only while the loop runs, is not stuck in one callback for loop_stall_limit (so the
  // livenessprobe sidecar restarts a wedged agent), the agent is not shutting down and
  // options.ready says so.
  grpc::ServerUnaryReactor* Probe(grpc::CallbackServerContext* ctx, const csi::v1::ProbeRequest* req,
                                  csi::v1::ProbeResponse* resp) override;

 private:
  Loop& loop_;
  RpcDispatcher& dispatcher_;
  const IdentityOptions options_;
};

}  // namespace fusekeeper
