#include "agent/csi/node_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "agent/csi/validate.h"

namespace fusekeeper {
namespace {

absl::Status NoVolumeManager(const char* method) {
  return absl::UnimplementedError(absl::StrCat(
      method, " is not available: this fusekeeper server runs without volume support"));
}

}  // namespace

NodeService::NodeService(Loop&, RpcDispatcher& dispatcher, NodeOptions options,
                         VolumeManager* volumes)
    : dispatcher_(dispatcher), options_(std::move(options)), volumes_(volumes) {}

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
                [this, req = *req](Responder r) mutable {
                  if (volumes_ == nullptr) return r.Finish(NoVolumeManager("NodeStageVolume"));
                  volumes_->Stage(req, [r = std::move(r)](absl::Status s) mutable { r.Finish(s); });
                });
}

grpc::ServerUnaryReactor* NodeService::NodeUnstageVolume(
    grpc::CallbackServerContext* ctx, const csi::v1::NodeUnstageVolumeRequest* req,
    csi::v1::NodeUnstageVolumeResponse* resp) {
  return Handle(ctx, "NodeUnstageVolume", *req, resp, ValidateNodeUnstage(*req),
                [this, req = *req](Responder r) mutable {
                  if (volumes_ == nullptr) return r.Finish(NoVolumeManager("NodeUnstageVolume"));
                  volumes_->Unstage(req, [r = std::move(r)](absl::Status s) mutable { r.Finish(s); });
                });
}

grpc::ServerUnaryReactor* NodeService::NodePublishVolume(
    grpc::CallbackServerContext* ctx, const csi::v1::NodePublishVolumeRequest* req,
    csi::v1::NodePublishVolumeResponse* resp) {
  return Handle(ctx, "NodePublishVolume", *req, resp, ValidateNodePublish(*req),
                [this, req = *req](Responder r) mutable {
                  if (volumes_ == nullptr) return r.Finish(NoVolumeManager("NodePublishVolume"));
                  volumes_->Publish(req, [r = std::move(r)](absl::Status s) mutable { r.Finish(s); });
                });
}

grpc::ServerUnaryReactor* NodeService::NodeUnpublishVolume(
    grpc::CallbackServerContext* ctx, const csi::v1::NodeUnpublishVolumeRequest* req,
    csi::v1::NodeUnpublishVolumeResponse* resp) {
  return Handle(ctx, "NodeUnpublishVolume", *req, resp, ValidateNodeUnpublish(*req),
                [this, req = *req](Responder r) mutable {
                  if (volumes_ == nullptr) return r.Finish(NoVolumeManager("NodeUnpublishVolume"));
                  volumes_->Unpublish(req, [r = std::move(r)](absl::Status s) mutable { r.Finish(s); });
                });
}

grpc::ServerUnaryReactor* NodeService::NodeGetVolumeStats(
    grpc::CallbackServerContext* ctx, const csi::v1::NodeGetVolumeStatsRequest* req,
    csi::v1::NodeGetVolumeStatsResponse* resp) {
  return Handle(ctx, "NodeGetVolumeStats", *req, resp, ValidateNodeGetVolumeStats(*req),
                [this, req = *req](Responder r) mutable {
                  if (volumes_ == nullptr) return r.Finish(NoVolumeManager("NodeGetVolumeStats"));
                  volumes_->Stats(req, [r = std::move(r)](
                      absl::StatusOr<csi::v1::NodeGetVolumeStatsResponse> resp) mutable {
                    if (!resp.ok()) return r.Finish(resp.status());
                    r.Reply(*resp);
                  });
                });
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
  // Only implemented capabilities are advertised.
  return dispatcher_.AnswerInline(ctx, "NodeGetCapabilities", *req, resp,
                                  [this](csi::v1::NodeGetCapabilitiesResponse* caps) {
                                    if (volumes_ != nullptr) {
                                      using T = csi::v1::NodeServiceCapability::RPC;
                                      for (auto type : {T::STAGE_UNSTAGE_VOLUME, T::GET_VOLUME_STATS,
                                                        T::VOLUME_CONDITION, T::SINGLE_NODE_MULTI_WRITER,
                                                        T::VOLUME_MOUNT_GROUP}) {
                                        caps->add_capabilities()->mutable_rpc()->set_type(type);
                                      }
                                    }
                                    return absl::OkStatus();
                                  });
}

grpc::ServerUnaryReactor* NodeService::NodeGetInfo(grpc::CallbackServerContext* ctx,
                                                   const csi::v1::NodeGetInfoRequest* req,
                                                   csi::v1::NodeGetInfoResponse* resp) {
  return dispatcher_.AnswerInline(ctx, "NodeGetInfo", *req, resp, [this](csi::v1::NodeGetInfoResponse* info) {
    info->set_node_id(options_.node_id);
    info->set_max_volumes_per_node(options_.max_volumes_per_node);
    return absl::OkStatus();
  });
}

}  // namespace fusekeeper
