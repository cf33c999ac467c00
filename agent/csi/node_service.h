// CSI Node service. Every request is validated per the spec first (missing or malformed fields →
// INVALID_ARGUMENT naming the field); valid requests then run on the loop thread.
//
// Mount work is done by the VolumeManager on the loop thread. A NodeService built without one
// (tests of the RPC layer alone) answers mount RPCs UNIMPLEMENTED and advertises no mount
// capabilities, so kubelet never relies on a missing feature.
#pragma once

#include <string>

#include "agent/csi/rpc.h"
#include "agent/loop/loop.h"
#include "agent/volume/volume_manager.h"
#include "proto/csi.grpc.pb.h"

namespace fusekeeper {

struct NodeOptions {
  std::string node_id;
  int64_t max_volumes_per_node = 0;  // 0: no limit
};

class NodeService final : public csi::v1::Node::CallbackService {
 public:
  // volumes may be null (see above); it must outlive the service.
  NodeService(Loop& loop, RpcDispatcher& dispatcher, NodeOptions options, VolumeManager* volumes);

  grpc::ServerUnaryReactor* NodeStageVolume(grpc::CallbackServerContext* ctx,
                                            const csi::v1::NodeStageVolumeRequest* req,
                                            csi::v1::NodeStageVolumeResponse* resp) override;
  grpc::ServerUnaryReactor* NodeUnstageVolume(grpc::CallbackServerContext* ctx,
                                              const csi::v1::NodeUnstageVolumeRequest* req,
                                              csi::v1::NodeUnstageVolumeResponse* resp) override;
  grpc::ServerUnaryReactor* NodePublishVolume(grpc::CallbackServerContext* ctx,
                                              const csi::v1::NodePublishVolumeRequest* req,
                                              csi::v1::NodePublishVolumeResponse* resp) override;
  grpc::ServerUnaryReactor* NodeUnpublishVolume(grpc::CallbackServerContext* ctx,
                                                const csi::v1::NodeUnpublishVolumeRequest* req,
                                                csi::v1::NodeUnpublishVolumeResponse* resp) override;
  grpc::ServerUnaryReactor* NodeGetVolumeStats(grpc::CallbackServerContext* ctx,
                                               const csi::v1::NodeGetVolumeStatsRequest* req,
                                               csi::v1::NodeGetVolumeStatsResponse* resp) override;
  grpc::ServerUnaryReactor* NodeExpandVolume(grpc::CallbackServerContext* ctx,
                                             const csi::v1::NodeExpandVolumeRequest* req,
                                             csi::v1::NodeExpandVolumeResponse* resp) override;
  grpc::ServerUnaryReactor* NodeGetCapabilities(grpc::CallbackServerContext* ctx,
                                                const csi::v1::NodeGetCapabilitiesRequest* req,
                                                csi::v1::NodeGetCapabilitiesResponse* resp) override;
  grpc::ServerUnaryReactor* NodeGetInfo(grpc::CallbackServerContext* ctx,
                                        const csi::v1::NodeGetInfoRequest* req,
                                        csi::v1::NodeGetInfoResponse* resp) override;

 private:
  // Validates on the gRPC thread (pure), then runs `work` on the loop thread.
  template <typename Req>
  grpc::ServerUnaryReactor* Handle(grpc::CallbackServerContext* ctx, const char* method,
                                   const Req& req, google::protobuf::Message* resp,
                                   absl::Status validation,
                                   absl::AnyInvocable<void(Responder)> work);

  RpcDispatcher& dispatcher_;
  const NodeOptions options_;
  VolumeManager* const volumes_;
};

}  // namespace fusekeeper
