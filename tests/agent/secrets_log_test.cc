// Every RPC, with secrets in every secret field and in mount flags, against the agent binary at
// its most verbose logging (-v=3): no secret value may appear anywhere in its output — success
// paths, error paths, and a FUSE volume whose secrets really are handed to its server.
#include <sys/socket.h>
#include <sys/un.h>

#include <filesystem>

#include "agent/fuse/handoff_protocol.h"
#include "gtest/gtest.h"
#include "proto/csi.grpc.pb.h"
#include "tests/testing/csi_client.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/mount_fixture.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

using namespace csi::v1;
namespace fs = std::filesystem;

const char* const kSecrets[] = {"S3cr3t-in-stage", "S3cr3t-in-publish", "S3cr3t-in-flag",
                                "S3cr3t-in-expand", "S3cr3t-in-invalid", "S3cr3t-for-fuse",
                                "S3cr3t-flag-fuse"};

TEST(SecretsLogTest, NoSecretValueReachesTheLogOnAnyRpc) {
  TmpfsDir root;
  const std::string kubelet = root.path() + "/kubelet", data = root.path() + "/data";
  fs::create_directories(kubelet + "/pods");
  fs::create_directories(data);
  Subprocess agent({RunfilePath("agent/fusekeeper"), "--endpoint=unix://" + root.path() + "/csi.sock",
                    "--node_id=n", "--kubelet_dir=" + kubelet, "--state_dir=" + root.path() + "/state",
                    "--v=3"});
  auto channel = DialUnixSocket(root.path() + "/csi.sock");
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() + kTestDeadline));
  auto node = Node::NewStub(channel);
  auto identity = Identity::NewStub(channel);
  auto ctx = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + kTestDeadline);
    return c;
  };
  ASSERT_TRUE(WaitForReadyAgent(channel, std::chrono::steady_clock::now() + kTestDeadline));

  { GetPluginInfoResponse r; auto c = ctx(); identity->GetPluginInfo(c.get(), {}, &r); }
  { GetPluginCapabilitiesResponse r; auto c = ctx(); identity->GetPluginCapabilities(c.get(), {}, &r); }
  { NodeGetInfoResponse r; auto c = ctx(); node->NodeGetInfo(c.get(), {}, &r); }
  { NodeGetCapabilitiesResponse r; auto c = ctx(); node->NodeGetCapabilities(c.get(), {}, &r); }

  const std::string staging = kubelet + "/plugins/s/globalmount";
  fs::create_directories(staging);
  NodeStageVolumeRequest stage;
  stage.set_volume_id("v");
  stage.set_staging_target_path(staging);
  *stage.mutable_volume_capability() = MountCapability();
  (*stage.mutable_secrets())["password"] = kSecrets[0];
  (*stage.mutable_volume_context())["kind"] = "hostPath";
  (*stage.mutable_volume_context())["path"] = data;
  { NodeStageVolumeResponse r; auto c = ctx(); ASSERT_TRUE(node->NodeStageVolume(c.get(), stage, &r).ok()); }
  // A refused mount flag that carries a secret: the error must not echo it.
  NodeStageVolumeRequest bad_stage = stage;
  bad_stage.set_volume_id("v-bad");
  bad_stage.mutable_volume_capability()->mutable_mount()->add_mount_flags(std::string("token=") + kSecrets[2]);
  { NodeStageVolumeResponse r; auto c = ctx(); EXPECT_FALSE(node->NodeStageVolume(c.get(), bad_stage, &r).ok()); }

  fs::create_directories(kubelet + "/pods/p/volumes/kubernetes.io~csi/v");
  const std::string target = kubelet + "/pods/p/volumes/kubernetes.io~csi/v/mount";
  NodePublishVolumeRequest pub;
  pub.set_volume_id("v");
  pub.set_staging_target_path(staging);
  pub.set_target_path(target);
  *pub.mutable_volume_capability() = MountCapability();
  (*pub.mutable_secrets())["token"] = kSecrets[1];
  { NodePublishVolumeResponse r; auto c = ctx(); ASSERT_TRUE(node->NodePublishVolume(c.get(), pub, &r).ok()); }
  // An invalid request (no volume id) with secrets.
  NodePublishVolumeRequest invalid = pub;
  invalid.clear_volume_id();
  (*invalid.mutable_secrets())["token"] = kSecrets[4];
  { NodePublishVolumeResponse r; auto c = ctx(); EXPECT_FALSE(node->NodePublishVolume(c.get(), invalid, &r).ok()); }
  {
    NodeGetVolumeStatsRequest s;
    s.set_volume_id("v");
    s.set_volume_path(target);
    NodeGetVolumeStatsResponse r;
    auto c = ctx();
    EXPECT_TRUE(node->NodeGetVolumeStats(c.get(), s, &r).ok());
  }
  {
    NodeExpandVolumeRequest e;
    e.set_volume_id("v");
    e.set_volume_path(target);
    (*e.mutable_secrets())["k"] = kSecrets[3];
    NodeExpandVolumeResponse r;
    auto c = ctx();
    node->NodeExpandVolume(c.get(), e, &r);
  }
  // A FUSE volume that asks for its secrets: they reach the server, not the log.
  const std::string pod = kubelet + "/pods/fp";
  fs::create_directories(pod + "/volumes/kubernetes.io~empty-dir/fk");
  fs::create_directories(pod + "/volumes/kubernetes.io~csi/f");
  NodePublishVolumeRequest fuse;
  fuse.set_volume_id("f");
  fuse.set_target_path(pod + "/volumes/kubernetes.io~csi/f/mount");
  *fuse.mutable_volume_capability() = MountCapability();
  fuse.mutable_volume_capability()->mutable_mount()->add_mount_flags(std::string("auth=") + kSecrets[6]);
  (*fuse.mutable_secrets())["key"] = kSecrets[5];
  (*fuse.mutable_volume_context())["kind"] = "fuse";
  (*fuse.mutable_volume_context())["passSecrets"] = "true";
  (*fuse.mutable_volume_context())["socketVolume"] = "fk";
  (*fuse.mutable_volume_context())["csi.storage.k8s.io/pod.uid"] = "fp";
  if (access("/dev/fuse", R_OK | W_OK) == 0) {
    NodePublishVolumeResponse r;
    auto c = ctx();
    ASSERT_TRUE(node->NodePublishVolume(c.get(), fuse, &r).ok());
    UniqueFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    strncpy(a.sun_path, (pod + "/volumes/kubernetes.io~empty-dir/fk/fusekeeper.sock").c_str(), sizeof(a.sun_path) - 1);
    ASSERT_EQ(connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    auto m = ReceiveHandoffMessage(s.get());
    ASSERT_TRUE(m.ok());
    auto config = DecodeMountConfig(m->payload);
    ASSERT_TRUE(config.ok());
    EXPECT_EQ(config->secrets.at("key"), kSecrets[5]) << "the server does get what it asked for";
    EXPECT_EQ(config->mount_options, std::vector<std::string>{std::string("auth=") + kSecrets[6]});
    ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply({.ok = true}), -1).ok());
    NodeUnpublishVolumeRequest u;
    u.set_volume_id("f");
    u.set_target_path(fuse.target_path());
    NodeUnpublishVolumeResponse ur;
    auto c2 = ctx();
    EXPECT_TRUE(node->NodeUnpublishVolume(c2.get(), u, &ur).ok());
  }
  {
    NodeUnpublishVolumeRequest u;
    u.set_volume_id("v");
    u.set_target_path(target);
    NodeUnpublishVolumeResponse r;
    auto c = ctx();
    EXPECT_TRUE(node->NodeUnpublishVolume(c.get(), u, &r).ok());
  }
  {
    NodeUnstageVolumeRequest u;
    u.set_volume_id("v");
    u.set_staging_target_path(staging);
    NodeUnstageVolumeResponse r;
    auto c = ctx();
    EXPECT_TRUE(node->NodeUnstageVolume(c.get(), u, &r).ok());
  }
  agent.Signal(SIGTERM);
  ASSERT_TRUE(agent.Wait(std::chrono::milliseconds(20000)).has_value());
  const std::string log = agent.Stderr();
  EXPECT_NE(log.find("NodeStageVolume"), std::string::npos) << "the requests are logged";
  EXPECT_NE(log.find("<redacted>"), std::string::npos);
  for (const char* secret : kSecrets) {
    EXPECT_EQ(log.find(secret), std::string::npos) << secret << " leaked into the log:\n" << log;
  }
}

}  // namespace
}  // namespace fusekeeper
