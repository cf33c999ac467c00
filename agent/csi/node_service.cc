#include "agent/csi/node_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "agent/csi/validate.h"

namespace fusekeeper {
namespace {

absl::Status NotBuiltYet(const char* method) {
  return absl::UnimplementedError(absl::StrCat(
      method, " is not available in this build of fusekeeper: volume mounting is not "
              "implemented yet (see NodeGetCapabilities for what is)"));
}

}  // namespace

NodeService::NodeService(Loop& loop, RpcDispatcher& dispatcher, NodeOptions options)
    : loop_(loop), dispatcher_(dispatcher), options_(std::move(options)) {}

template <typename Req>
grpc::ServerUnaryReactor* NodeService::Handle(grpc::CallbackServerContext* ctx, const char* method,
                                              const Req& req, google::protobuf::Message* resp,
                                              absl::Status validation,
                                              absl::AnyInvocable<void(Responder)> work) {
  if (!validation.ok()) {
    return dispatcher_.Dispatch(ctx, method, /*quiet=*/false, req, resp,
                                [validation](Responder r) { r.Finish(validation); });
  }
  return dispatcher_.Dispatch(ctx, method, /*quiet=*/false, req, resp, std::move(work));
}

grpc::ServerUnaryReactor* NodeService::NodeStageVolume(grpc::CallbackServerContext* ctx,
                                                       const csi::v1::NodeStageVolumeRequest* req,
                                                       csi::v1::NodeStageVolumeResponse* resp) {
  return Handle(ctx, "NodeStageVolume", *req, resp, ValidateNodeStage(*req),
                [](Responder r) { r.Finish(NotBuiltYet("NodeStageVolume")); });
}

grpc::ServerUnaryReactor* NodeService::NodeUnstageVolume(
    grpc::CallbackServerContext* ctx, const csi::v1::NodeUnstageVolumeRequest* req,
    csi::v1::NodeUnstageVolumeResponse* resp) {
  return Handle(ctx, "NodeUnstageVolume", *req, resp, ValidateNodeUnstage(*req),
                [](Responder r) { r.Finish(NotBuiltYet("NodeUnstageVolume")); });
}

grpc::ServerUnaryReactor* NodeService::NodePublishVolume(
    grpc::CallbackServerContext* ctx, const csi::v1::NodePublishVolumeRequest* req,
    csi::v1::NodePublishVolumeResponse* resp) {
  return Handle(ctx, "NodePublishVolume", *req, resp, ValidateNodePublish(*req),
                [](Responder r) { r.Finish(NotBuiltYet("NodePublishVolume")); });
}

grpc::ServerUnaryReactor* NodeService::NodeUnpublishVolume(
    grpc::CallbackServerContext* ctx, const csi::v1::NodeUnpublishVolumeRequest* req,
    csi::v1::NodeUnpublishVolumeResponse* resp) {
  return Handle(ctx, "NodeUnpublishVolume", *req, resp, ValidateNodeUnpublish(*req),
                [](Responder r) { r.Finish(NotBuiltYet("NodeUnpublishVolume")); });
}

grpc::ServerUnaryReactor* NodeService::NodeGetVolumeStats(
    grpc::CallbackServerContext* ctx, const csi::v1::NodeGetVolumeStatsRequest* req,
    csi::v1::NodeGetVolumeStatsResponse* resp) {
  return Handle(ctx, "NodeGetVolumeStats", *req, resp, ValidateNodeGetVolumeStats(*req),
                [](Responder r) { r.Finish(NotBuiltYet("NodeGetVolumeStats")); });
}

grpc::ServerUnaryReactor* NodeService::NodeExpandVolume(
    grpc::CallbackServerContext* ctx, const csi::v1::NodeExpandVolumeRequest* req,
    csi::v1::NodeExpandVolumeResponse* resp) {
  // EXPAND_VOLUME is never advertised: FUSE volumes have no node-side size to grow.
  return Handle(ctx, "NodeExpandVolume", *req, resp, ValidateNodeExpand(*req), [](Responder r) {
    r.Finish(absl::UnimplementedError(
        "NodeExpandVolume is not supported: FUSE volumes have no node-side size to expand"));
  });
}

grpc::ServerUnaryReactor* NodeService::NodeGetCapabilities(
    grpc::CallbackServerContext* ctx, const csi::v1::NodeGetCapabilitiesRequest* req,
    csi::v1::NodeGetCapabilitiesResponse* resp) {
  // Only implemented capabilities are advertised; mount-related ones (STAGE_UNSTAGE_VOLUME,
  // GET_VOLUME_STATS, VOLUME_CONDITION, VOLUME_MOUNT_GROUP) arrive with the mount engine.
  return dispatcher_.Dispatch(ctx, "NodeGetCapabilities", /*quiet=*/true, *req, resp,
                              [](Responder r) { r.Finish(absl::OkStatus()); });
}

grpc::ServerUnaryReactor* NodeService::NodeGetInfo(grpc::CallbackServerContext* ctx,
                                                   const csi::v1::NodeGetInfoRequest* req,
                                                   csi::v1::NodeGetInfoResponse* resp) {
  return dispatcher_.Dispatch(ctx, "NodeGetInfo", /*quiet=*/true, *req, resp, [this](Responder r) {
    csi::v1::NodeGetInfoResponse info;
    info.set_node_id(options_.node_id);
    info.set_max_volumes_per_node(options_.max_volumes_per_node);
    r.Reply(info);
  });
}

}  // namespace fusekeeper
