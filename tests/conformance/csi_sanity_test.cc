// A C++ mirror of the csi-sanity (kubernetes-csi/csi-test) cases that need no mounting: the
// Identity service and the Node RPCs' GetCapabilities, GetInfo and missing-argument checks.
// csi-sanity itself is a Go program and cannot be fetched on this offline build; each test here
// names the csi-sanity case it mirrors. Runs against the real agent binary over its socket.
#include <grpcpp/grpcpp.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <regex>

#include "gtest/gtest.h"
#include "proto/csi.grpc.pb.h"
#include "tests/testing/csi_client.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

using namespace csi::v1;

class CsiSanityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ShortTempDir();
    const std::string sock = dir_->path() + "/csi.sock";
    mkdir((dir_->path() + "/kubelet").c_str(), 0755);
    agent_ = new Subprocess({RunfilePath("agent/fusekeeper"), "--endpoint=unix://" + sock,
                             "--node_id=sanity-node", "--kubelet_dir=" + dir_->path() + "/kubelet",
                             "--state_dir=" + dir_->path() + "/state"});
    channel_ = new std::shared_ptr<grpc::Channel>(DialUnixSocket(sock));
    ASSERT_TRUE((*channel_)->WaitForConnected(std::chrono::system_clock::now() + kTestDeadline))
        << agent_->Stderr();
  }
  static void TearDownTestSuite() {
    delete channel_;
    agent_->Signal(SIGTERM);
    agent_->Wait(std::chrono::milliseconds(20000));
    delete agent_;
    delete dir_;
  }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + kTestDeadline);
    return ctx;
  }
  std::unique_ptr<Identity::Stub> identity() { return Identity::NewStub(*channel_); }
  std::unique_ptr<Node::Stub> node() { return Node::NewStub(*channel_); }
  bool HasNodeCap(NodeServiceCapability::RPC::Type type) {
    NodeGetCapabilitiesResponse resp;
    auto ctx = Ctx();
    EXPECT_TRUE(node()->NodeGetCapabilities(ctx.get(), {}, &resp).ok());
    for (const auto& c : resp.capabilities()) {
      if (c.rpc().type() == type) return true;
    }
    return false;
  }

  static ShortTempDir* dir_;
  static Subprocess* agent_;
  static std::shared_ptr<grpc::Channel>* channel_;
};
ShortTempDir* CsiSanityTest::dir_ = nullptr;
Subprocess* CsiSanityTest::agent_ = nullptr;
std::shared_ptr<grpc::Channel>* CsiSanityTest::channel_ = nullptr;

// "Identity Service GetPluginCapabilities should return appropriate capabilities"
TEST_F(CsiSanityTest, IdentityGetPluginCapabilitiesReturnsAppropriateCapabilities) {
  GetPluginCapabilitiesResponse resp;
  auto ctx = Ctx();
  ASSERT_TRUE(identity()->GetPluginCapabilities(ctx.get(), {}, &resp).ok());
  for (const auto& cap : resp.capabilities()) {
    switch (cap.type_case()) {
      case PluginCapability::kService:
        EXPECT_TRUE(cap.service().type() == PluginCapability::Service::CONTROLLER_SERVICE ||
                    cap.service().type() ==
                        PluginCapability::Service::VOLUME_ACCESSIBILITY_CONSTRAINTS ||
                    cap.service().type() == PluginCapability::Service::GROUP_CONTROLLER_SERVICE);
        break;
      case PluginCapability::kVolumeExpansion:
        EXPECT_TRUE(cap.volume_expansion().type() == PluginCapability::VolumeExpansion::ONLINE ||
                    cap.volume_expansion().type() == PluginCapability::VolumeExpansion::OFFLINE);
        break;
      default:
        ADD_FAILURE() << "unknown capability";
    }
  }
}

// "Identity Service Probe should return appropriate information"
TEST_F(CsiSanityTest, IdentityProbeReturnsAppropriateInformation) {
  ProbeResponse resp;
  auto ctx = Ctx();
  grpc::Status s = identity()->Probe(ctx.get(), {}, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  if (resp.has_ready()) EXPECT_TRUE(resp.ready().value());
}

// "Identity Service GetPluginInfo should return appropriate information"
TEST_F(CsiSanityTest, IdentityGetPluginInfoReturnsAppropriateInformation) {
  GetPluginInfoResponse resp;
  auto ctx = Ctx();
  ASSERT_TRUE(identity()->GetPluginInfo(ctx.get(), {}, &resp).ok());
  EXPECT_FALSE(resp.name().empty());
  EXPECT_FALSE(resp.vendor_version().empty());
  // The exact pattern csi-sanity applies to the name.
  EXPECT_TRUE(std::regex_match(resp.name(), std::regex("^[a-zA-Z][A-Za-z0-9-\\.\\_]{0,61}[a-zA-Z]$")))
      << resp.name();
}

// "Node Service NodeGetCapabilities should return appropriate capabilities"
TEST_F(CsiSanityTest, NodeGetCapabilitiesReturnsAppropriateCapabilities) {
  NodeGetCapabilitiesResponse resp;
  auto ctx = Ctx();
  ASSERT_TRUE(node()->NodeGetCapabilities(ctx.get(), {}, &resp).ok());
  for (const auto& cap : resp.capabilities()) {
    ASSERT_EQ(cap.type_case(), NodeServiceCapability::kRpc);
    const auto t = cap.rpc().type();
    EXPECT_TRUE(t == NodeServiceCapability::RPC::STAGE_UNSTAGE_VOLUME ||
                t == NodeServiceCapability::RPC::GET_VOLUME_STATS ||
                t == NodeServiceCapability::RPC::EXPAND_VOLUME ||
                t == NodeServiceCapability::RPC::VOLUME_CONDITION ||
                t == NodeServiceCapability::RPC::SINGLE_NODE_MULTI_WRITER ||
                t == NodeServiceCapability::RPC::VOLUME_MOUNT_GROUP)
        << t;
  }
}

// "Node Service NodeGetInfo should return appropriate values"
TEST_F(CsiSanityTest, NodeGetInfoReturnsAppropriateValues) {
  NodeGetInfoResponse resp;
  auto ctx = Ctx();
  ASSERT_TRUE(node()->NodeGetInfo(ctx.get(), {}, &resp).ok());
  EXPECT_EQ(resp.node_id(), "sanity-node");
  EXPECT_GE(resp.max_volumes_per_node(), 0);
}

// "Node Service NodePublishVolume should fail when no volume id / no target path / no volume
// capability provided"
TEST_F(CsiSanityTest, NodePublishVolumeFailsOnMissingArguments) {
  NodePublishVolumeResponse resp;
  NodePublishVolumeRequest r;
  auto c1 = Ctx();
  EXPECT_EQ(node()->NodePublishVolume(c1.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
  r.set_volume_id("id");
  auto c2 = Ctx();
  EXPECT_EQ(node()->NodePublishVolume(c2.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
  r.set_target_path(dir_->path() + "/target");
  auto c3 = Ctx();
  EXPECT_EQ(node()->NodePublishVolume(c3.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
}

// "Node Service NodeUnpublishVolume should fail when no volume id / no target path provided"
TEST_F(CsiSanityTest, NodeUnpublishVolumeFailsOnMissingArguments) {
  NodeUnpublishVolumeResponse resp;
  NodeUnpublishVolumeRequest r;
  auto c1 = Ctx();
  EXPECT_EQ(node()->NodeUnpublishVolume(c1.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
  r.set_volume_id("id");
  auto c2 = Ctx();
  EXPECT_EQ(node()->NodeUnpublishVolume(c2.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
}

// "Node Service NodeStageVolume should fail when no volume id / no staging target path / no
// volume capability provided" (csi-sanity runs these only with STAGE_UNSTAGE_VOLUME; we run
// them always, since validation must hold either way)
TEST_F(CsiSanityTest, NodeStageVolumeFailsOnMissingArguments) {
  NodeStageVolumeResponse resp;
  NodeStageVolumeRequest r;
  *r.mutable_volume_capability() = MountCapability();
  r.set_staging_target_path(dir_->path() + "/stage");
  auto c1 = Ctx();
  EXPECT_EQ(node()->NodeStageVolume(c1.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
  r.set_volume_id("id");
  r.clear_staging_target_path();
  auto c2 = Ctx();
  EXPECT_EQ(node()->NodeStageVolume(c2.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
  r.set_staging_target_path(dir_->path() + "/stage");
  r.clear_volume_capability();
  auto c3 = Ctx();
  EXPECT_EQ(node()->NodeStageVolume(c3.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
}

// "Node Service NodeUnstageVolume should fail when no volume id / no staging target path"
TEST_F(CsiSanityTest, NodeUnstageVolumeFailsOnMissingArguments) {
  NodeUnstageVolumeResponse resp;
  NodeUnstageVolumeRequest r;
  r.set_staging_target_path(dir_->path() + "/stage");
  auto c1 = Ctx();
  EXPECT_EQ(node()->NodeUnstageVolume(c1.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
  r.set_volume_id("id");
  r.clear_staging_target_path();
  auto c2 = Ctx();
  EXPECT_EQ(node()->NodeUnstageVolume(c2.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
}

// "Node Service NodeGetVolumeStats should fail when no volume id / no volume path provided"
TEST_F(CsiSanityTest, NodeGetVolumeStatsFailsOnMissingArguments) {
  NodeGetVolumeStatsResponse resp;
  NodeGetVolumeStatsRequest r;
  r.set_volume_path(dir_->path());
  auto c1 = Ctx();
  EXPECT_EQ(node()->NodeGetVolumeStats(c1.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
  r.set_volume_id("id");
  r.clear_volume_path();
  auto c2 = Ctx();
  EXPECT_EQ(node()->NodeGetVolumeStats(c2.get(), r, &resp).error_code(), grpc::INVALID_ARGUMENT);
}

// "Node Service NodeGetVolumeStats should fail when volume is not found"
TEST_F(CsiSanityTest, NodeGetVolumeStatsFailsWhenVolumeIsNotFound) {
  ASSERT_TRUE(HasNodeCap(NodeServiceCapability::RPC::GET_VOLUME_STATS));
  NodeGetVolumeStatsRequest r;
  r.set_volume_id("no-such-volume");
  r.set_volume_path(dir_->path() + "/kubelet/pods/x/volumes/kubernetes.io~csi/v/mount");
  NodeGetVolumeStatsResponse resp;
  auto ctx = Ctx();
  EXPECT_EQ(node()->NodeGetVolumeStats(ctx.get(), r, &resp).error_code(), grpc::NOT_FOUND);
  // Whatever the path looks like (the conformance suite sends a relative one).
  r.set_volume_path("some/relative/path");
  auto ctx2 = Ctx();
  grpc::Status s = node()->NodeGetVolumeStats(ctx2.get(), r, &resp);
  EXPECT_EQ(s.error_code(), grpc::NOT_FOUND) << s.error_message();
}

// csi-sanity's node-only cycle ("should work", "should be idempotent", "should remove target
// path", "NodeGetVolumeStats should fail when volume does not exist on the specified path"), with
// a host-path volume standing in for one a controller would have created.
TEST_F(CsiSanityTest, StagePublishStatsUnpublishUnstageCycle) {
  ASSERT_TRUE(HasNodeCap(NodeServiceCapability::RPC::STAGE_UNSTAGE_VOLUME));
  const std::string kubelet = dir_->path() + "/kubelet";
  const std::string staging = kubelet + "/plugins/sanity/globalmount";
  const std::string target_parent = kubelet + "/pods/sanity/volumes/kubernetes.io~csi/v";
  const std::string target = target_parent + "/mount";
  const std::string host = dir_->path() + "/host";
  for (const std::string& d : {staging, target_parent, host}) std::filesystem::create_directories(d);
  NodeStageVolumeRequest stage;
  stage.set_volume_id("sanity-vol");
  stage.set_staging_target_path(staging);
  *stage.mutable_volume_capability() = MountCapability();
  (*stage.mutable_volume_context())["kind"] = "hostPath";
  (*stage.mutable_volume_context())["path"] = host;
  for (int i = 0; i < 2; ++i) {  // idempotent
    NodeStageVolumeResponse resp;
    auto ctx = Ctx();
    grpc::Status s = node()->NodeStageVolume(ctx.get(), stage, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << agent_->Stderr();
  }
  NodePublishVolumeRequest pub;
  pub.set_volume_id("sanity-vol");
  pub.set_staging_target_path(staging);
  pub.set_target_path(target);
  *pub.mutable_volume_capability() = MountCapability();
  for (int i = 0; i < 2; ++i) {
    NodePublishVolumeResponse resp;
    auto ctx = Ctx();
    grpc::Status s = node()->NodePublishVolume(ctx.get(), pub, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  NodeGetVolumeStatsRequest st;
  st.set_volume_id("sanity-vol");
  st.set_volume_path(target);
  NodeGetVolumeStatsResponse stats;
  auto c1 = Ctx();
  ASSERT_TRUE(node()->NodeGetVolumeStats(c1.get(), st, &stats).ok());
  EXPECT_FALSE(stats.volume_condition().abnormal());
  st.set_volume_path(kubelet + "/pods/other/volumes/kubernetes.io~csi/v/mount");
  auto c2 = Ctx();
  EXPECT_EQ(node()->NodeGetVolumeStats(c2.get(), st, &stats).error_code(), grpc::NOT_FOUND);
  NodeUnpublishVolumeRequest unpub;
  unpub.set_volume_id("sanity-vol");
  unpub.set_target_path(target);
  for (int i = 0; i < 2; ++i) {
    NodeUnpublishVolumeResponse resp;
    auto ctx = Ctx();
    ASSERT_TRUE(node()->NodeUnpublishVolume(ctx.get(), unpub, &resp).ok());
  }
  EXPECT_NE(access(target.c_str(), F_OK), 0) << "unpublish must remove the target path";
  NodeUnstageVolumeRequest unstage;
  unstage.set_volume_id("sanity-vol");
  unstage.set_staging_target_path(staging);
  for (int i = 0; i < 2; ++i) {
    NodeUnstageVolumeResponse resp;
    auto ctx = Ctx();
    ASSERT_TRUE(node()->NodeUnstageVolume(ctx.get(), unstage, &resp).ok());
  }
}

// Kubelet relies on advertised capabilities: nothing may be advertised that answers UNIMPLEMENTED.
TEST_F(CsiSanityTest, AdvertisedNodeCapabilitiesAreImplemented) {
  if (HasNodeCap(NodeServiceCapability::RPC::STAGE_UNSTAGE_VOLUME)) {
    NodeStageVolumeRequest r;
    r.set_volume_id("probe");
    r.set_staging_target_path(dir_->path() + "/stage");
    *r.mutable_volume_capability() = MountCapability();
    NodeStageVolumeResponse resp;
    auto ctx = Ctx();
    EXPECT_NE(node()->NodeStageVolume(ctx.get(), r, &resp).error_code(), grpc::UNIMPLEMENTED);
  }
  if (HasNodeCap(NodeServiceCapability::RPC::GET_VOLUME_STATS)) {
    NodeGetVolumeStatsRequest r;
    r.set_volume_id("probe");
    r.set_volume_path(dir_->path());
    NodeGetVolumeStatsResponse resp;
    auto ctx = Ctx();
    EXPECT_NE(node()->NodeGetVolumeStats(ctx.get(), r, &resp).error_code(), grpc::UNIMPLEMENTED);
  }
  EXPECT_FALSE(HasNodeCap(NodeServiceCapability::RPC::EXPAND_VOLUME));
}

}  // namespace
}  // namespace fusekeeper
