#include "agent/csi/identity_service.h"

#include <utility>

namespace fusekeeper {

IdentityService::IdentityService(Loop& loop, RpcDispatcher& dispatcher, IdentityOptions options)
    : loop_(loop), dispatcher_(dispatcher), options_(std::move(options)) {}

grpc::ServerUnaryReactor* IdentityService::GetPluginInfo(grpc::CallbackServerContext* ctx,
                                                         const csi::v1::GetPluginInfoRequest* req,
                                                         csi::v1::GetPluginInfoResponse* resp) {
  return dispatcher_.Dispatch(ctx, "GetPluginInfo", /*quiet=*/true, *req, resp, [this](Responder r) {
    csi::v1::GetPluginInfoResponse info;
    info.set_name(options_.driver_name);
    info.set_vendor_version(options_.vendor_version);
    for (const auto& [k, v] : options_.manifest) (*info.mutable_manifest())[k] = v;
    r.Reply(info);
  });
}

grpc::ServerUnaryReactor* IdentityService::GetPluginCapabilities(
    grpc::CallbackServerContext* ctx, const csi::v1::GetPluginCapabilitiesRequest* req,
    csi::v1::GetPluginCapabilitiesResponse* resp) {
  // A node-only plugin: no CONTROLLER_SERVICE, and volumes are reachable from every node, so no
  // VOLUME_ACCESSIBILITY_CONSTRAINTS. The response is legitimately empty.
  return dispatcher_.Dispatch(ctx, "GetPluginCapabilities", /*quiet=*/true, *req, resp,
                              [](Responder r) { r.Finish(absl::OkStatus()); });
}

grpc::ServerUnaryReactor* IdentityService::Probe(grpc::CallbackServerContext* ctx,
                                                 const csi::v1::ProbeRequest* req,
                                                 csi::v1::ProbeResponse* resp) {
  return dispatcher_.Dispatch(ctx, "Probe", /*quiet=*/true, *req, resp, [this](Responder r) {
    csi::v1::ProbeResponse probe;
    probe.mutable_ready()->set_value(loop_.running() && !dispatcher_.draining() &&
                                     (!options_.ready || options_.ready()));
    r.Reply(probe);
  });
}

}  // namespace fusekeeper
