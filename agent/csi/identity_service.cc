#include "agent/csi/identity_service.h"

#include <utility>

namespace fusekeeper {

IdentityService::IdentityService(Loop& loop, RpcDispatcher& dispatcher, IdentityOptions options)
    : loop_(loop), dispatcher_(dispatcher), options_(std::move(options)) {}

grpc::ServerUnaryReactor* IdentityService::GetPluginInfo(grpc::CallbackServerContext* ctx,
                                                         const csi::v1::GetPluginInfoRequest* req,
                                                         csi::v1::GetPluginInfoResponse* resp) {
  return dispatcher_.AnswerInline(ctx, "GetPluginInfo", *req, resp, [this](csi::v1::GetPluginInfoResponse* info) {
    info->set_name(options_.driver_name);
    info->set_vendor_version(options_.vendor_version);
    for (const auto& [k, v] : options_.manifest) (*info->mutable_manifest())[k] = v;
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* IdentityService::GetPluginCapabilities(
    grpc::CallbackServerContext* ctx, const csi::v1::GetPluginCapabilitiesRequest* req,
    csi::v1::GetPluginCapabilitiesResponse* resp) {
  // A node-only plugin: no CONTROLLER_SERVICE, and volumes are reachable from every node, so no
  // VOLUME_ACCESSIBILITY_CONSTRAINTS. The response is legitimately empty.
  return dispatcher_.AnswerInline(ctx, "GetPluginCapabilities", *req, resp,
                                  [](csi::v1::GetPluginCapabilitiesResponse*) { return absl::OkStatus(); });
}

grpc::ServerUnaryReactor* IdentityService::Probe(grpc::CallbackServerContext* ctx,
                                                 const csi::v1::ProbeRequest* req,
                                                 csi::v1::ProbeResponse* resp) {
  return dispatcher_.AnswerInline(ctx, "Probe", *req, resp, [this](csi::v1::ProbeResponse* probe) {
    if (loop_.stop_requested()) return absl::UnavailableError("fusekeeper event loop has stopped");
    const auto busy = loop_.busy_for();
    const bool stalled = busy >= absl::ToChronoNanoseconds(options_.loop_stall_limit);
    LOG_IF(WARNING, stalled) << "Probe: the event loop has been busy for "
                             << absl::FormatDuration(absl::FromChrono(busy)) << " without waiting: not ready";
    // Not ready until the loop runs (it may not have started yet) and while it is stuck.
    probe->mutable_ready()->set_value(loop_.running() && !stalled && !dispatcher_.draining() &&
                                      (!options_.ready || options_.ready()));
    return absl::OkStatus();
  });
}

}  // namespace fusekeeper
