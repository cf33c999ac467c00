// The CSI server in-process, called by a real gRPC client over a real Unix socket.
#include "agent/csi/server.h"

#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <future>

#include <functional>
#include <mutex>

#include "agent/base/unique_fd.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "gtest/gtest.h"
#include "proto/csi.grpc.pb.h"
#include "tests/testing/csi_client.h"
#include "tests/testing/log_capture.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

using csi::v1::VolumeCapability;

class CsiServerTest : public ::testing::Test {
 public:  // the table-driven test calls these through lambdas
  void SetUp() override {
    CsiServerOptions options;
    options.endpoint = "unix://" + dir_.path() + "/csi.sock";
    options.identity.driver_name = "fusekeeper.csi";
    options.identity.vendor_version = "9.9.9-test";
    options.identity.manifest = {{"k", "v"}};
    options.node.node_id = "node-a";
    // Long enough that a loop merely descheduled on a loaded machine is not taken for wedged.
    options.identity.loop_stall_limit = absl::Seconds(1);
    auto server = CsiServer::Start(lt_.loop(), options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = grpc::CreateChannel("unix:" + server_->socket_path(),
                                   grpc::InsecureChannelCredentials());
    identity_ = csi::v1::Identity::NewStub(channel_);
    node_ = csi::v1::Node::NewStub(channel_);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(5));
  }

  // Probe answers on gRPC's thread: right after SetUp the loop thread may not run yet (not ready,
  // but never an error). Waits, bounded, until it says ready.
  bool ProbeBecomesReady() {
    const auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
    while (std::chrono::steady_clock::now() < deadline) {
      csi::v1::ProbeResponse resp;
      auto ctx = Ctx();
      grpc::Status s = identity_->Probe(ctx.get(), {}, &resp);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok()) return false;
      if (resp.ready().value()) return true;
    }
    return false;
  }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + kTestDeadline);
    return ctx;
  }

  ShortTempDir dir_;
  LoopThread lt_;
  std::unique_ptr<CsiServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<csi::v1::Identity::Stub> identity_;
  std::unique_ptr<csi::v1::Node::Stub> node_;
};

TEST_F(CsiServerTest, SocketIsOwnerAndGroupOnly) {
  struct stat st;
  ASSERT_EQ(lstat(server_->socket_path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
}

TEST_F(CsiServerTest, GetPluginInfo) {
  csi::v1::GetPluginInfoResponse resp;
  auto ctx = Ctx();
  grpc::Status s = identity_->GetPluginInfo(ctx.get(), {}, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.name(), "fusekeeper.csi");
  EXPECT_EQ(resp.vendor_version(), "9.9.9-test");
  EXPECT_EQ(resp.manifest().at("k"), "v");
}

TEST_F(CsiServerTest, PluginCapabilitiesAdvertiseNoControllerService) {
  csi::v1::GetPluginCapabilitiesResponse resp;
  auto ctx = Ctx();
  ASSERT_TRUE(identity_->GetPluginCapabilities(ctx.get(), {}, &resp).ok());
  for (const auto& cap : resp.capabilities()) {
    EXPECT_NE(cap.service().type(), csi::v1::PluginCapability::Service::CONTROLLER_SERVICE);
  }
}

TEST_F(CsiServerTest, ProbeIsReadyWhileTheLoopRunsAndUnavailableWhenDraining) {
  ASSERT_TRUE(ProbeBecomesReady());
  csi::v1::ProbeResponse resp;
  auto ctx = Ctx();
  ASSERT_TRUE(identity_->Probe(ctx.get(), {}, &resp).ok());
  ASSERT_TRUE(resp.has_ready());
  EXPECT_TRUE(resp.ready().value());

  server_->BeginDraining();
  auto ctx2 = Ctx();
  grpc::Status s = identity_->Probe(ctx2.get(), {}, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(s.error_message().find("shutting down"), std::string::npos);
}

// Probe is answered on gRPC's thread (no hop), yet a loop stuck in one callback still makes it
// not ready, so the livenessprobe sidecar restarts a wedged agent; and ready again once it moves.
TEST_F(CsiServerTest, ProbeIsNotReadyWhileTheLoopIsWedgedAndReadyAgainAfter) {
  auto ready = [&] {
    csi::v1::ProbeResponse resp;
    auto ctx = Ctx();
    grpc::Status s = identity_->Probe(ctx.get(), {}, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.ready().value();
  };
  ASSERT_TRUE(ProbeBecomesReady());
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  ASSERT_TRUE(lt_.loop().Post([&entered, released] {
    entered.set_value();
    released.wait();  // the wedge
  }));
  ASSERT_EQ(entered.get_future().wait_for(kTestDeadline), std::future_status::ready);
  const auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
  bool saw_not_ready = false;
  while (!saw_not_ready && std::chrono::steady_clock::now() < deadline) saw_not_ready = !ready();
  EXPECT_TRUE(saw_not_ready) << "answered while the loop was wedged, and said not ready";
  release.set_value();
  bool ready_again = false;
  while (!ready_again && std::chrono::steady_clock::now() < deadline) ready_again = ready();
  EXPECT_TRUE(ready_again);
}

TEST_F(CsiServerTest, RpcsAfterTheLoopStoppedFailFastInsteadOfHanging) {
  lt_.StopAndJoin();
  csi::v1::ProbeResponse resp;
  auto ctx = Ctx();
  grpc::Status s = identity_->Probe(ctx.get(), {}, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
}

TEST_F(CsiServerTest, NodeGetInfoAndCapabilities) {
  csi::v1::NodeGetInfoResponse info;
  auto ctx = Ctx();
  ASSERT_TRUE(node_->NodeGetInfo(ctx.get(), {}, &info).ok());
  EXPECT_EQ(info.node_id(), "node-a");
  EXPECT_EQ(info.max_volumes_per_node(), 0);

  csi::v1::NodeGetCapabilitiesResponse caps;
  auto ctx2 = Ctx();
  ASSERT_TRUE(node_->NodeGetCapabilities(ctx2.get(), {}, &caps).ok());
  // Nothing mount-related is advertised until the mount engine exists; every advertised type
  // must be a known one (csi-sanity's check).
  for (const auto& cap : caps.capabilities()) {
    EXPECT_TRUE(csi::v1::NodeServiceCapability::RPC::Type_IsValid(cap.rpc().type()));
    EXPECT_NE(cap.rpc().type(), csi::v1::NodeServiceCapability::RPC::UNKNOWN);
  }
}

struct Case {
  std::string name;
  std::function<grpc::Status(CsiServerTest*)> call;
  grpc::StatusCode code;
  std::string mentions;
};

// Every validation path of every Node RPC, in the order csi-sanity and kubelet exercise them.
TEST_F(CsiServerTest, EveryNodeValidationErrorPath) {
  using namespace csi::v1;
  auto stage = [](std::function<void(NodeStageVolumeRequest&)> edit) {
    return [edit](CsiServerTest* t) {
      NodeStageVolumeRequest r;
      r.set_volume_id("v");
      r.set_staging_target_path("/stage");
      *r.mutable_volume_capability() = MountCapability();
      edit(r);
      NodeStageVolumeResponse resp;
      auto ctx = t->Ctx();
      return t->node_->NodeStageVolume(ctx.get(), r, &resp);
    };
  };
  auto publish = [](std::function<void(NodePublishVolumeRequest&)> edit) {
    return [edit](CsiServerTest* t) {
      NodePublishVolumeRequest r;
      r.set_volume_id("v");
      r.set_target_path("/target");
      *r.mutable_volume_capability() = MountCapability();
      edit(r);
      NodePublishVolumeResponse resp;
      auto ctx = t->Ctx();
      return t->node_->NodePublishVolume(ctx.get(), r, &resp);
    };
  };
  auto unstage = [](std::string id, std::string path) {
    return [=](CsiServerTest* t) {
      NodeUnstageVolumeRequest r;
      r.set_volume_id(id);
      r.set_staging_target_path(path);
      NodeUnstageVolumeResponse resp;
      auto ctx = t->Ctx();
      return t->node_->NodeUnstageVolume(ctx.get(), r, &resp);
    };
  };
  auto unpublish = [](std::string id, std::string path) {
    return [=](CsiServerTest* t) {
      NodeUnpublishVolumeRequest r;
      r.set_volume_id(id);
      r.set_target_path(path);
      NodeUnpublishVolumeResponse resp;
      auto ctx = t->Ctx();
      return t->node_->NodeUnpublishVolume(ctx.get(), r, &resp);
    };
  };
  auto stats = [](std::string id, std::string path) {
    return [=](CsiServerTest* t) {
      NodeGetVolumeStatsRequest r;
      r.set_volume_id(id);
      r.set_volume_path(path);
      NodeGetVolumeStatsResponse resp;
      auto ctx = t->Ctx();
      return t->node_->NodeGetVolumeStats(ctx.get(), r, &resp);
    };
  };
  const auto IA = grpc::StatusCode::INVALID_ARGUMENT;
  std::vector<Case> cases = {
      {"stage/no volume id", stage([](auto& r) { r.clear_volume_id(); }), IA, "volume_id is required"},
      {"stage/no staging path", stage([](auto& r) { r.clear_staging_target_path(); }), IA,
       "staging_target_path is required"},
      {"stage/no capability", stage([](auto& r) { r.clear_volume_capability(); }), IA,
       "volume_capability is required"},
      {"stage/no access type", stage([](auto& r) { r.mutable_volume_capability()->clear_mount(); }),
       IA, "access_type"},
      {"stage/block", stage([](auto& r) { r.mutable_volume_capability()->mutable_block(); }), IA,
       "block volumes are not supported"},
      {"stage/no access mode",
       stage([](auto& r) { r.mutable_volume_capability()->clear_access_mode(); }), IA,
       "access_mode"},
      {"stage/relative path", stage([](auto& r) { r.set_staging_target_path("stage"); }), IA,
       "absolute"},
      {"stage/long id", stage([](auto& r) { r.set_volume_id(std::string(200, 'x')); }), IA,
       "200 bytes"},
      {"unstage/no volume id", unstage("", "/stage"), IA, "volume_id is required"},
      {"unstage/no staging path", unstage("v", ""), IA, "staging_target_path is required"},
      {"publish/no volume id", publish([](auto& r) { r.clear_volume_id(); }), IA,
       "volume_id is required"},
      {"publish/no target path", publish([](auto& r) { r.clear_target_path(); }), IA,
       "target_path is required"},
      {"publish/no capability", publish([](auto& r) { r.clear_volume_capability(); }), IA,
       "volume_capability is required"},
      {"publish/block", publish([](auto& r) { r.mutable_volume_capability()->mutable_block(); }),
       IA, "block"},
      {"publish/NUL in target", publish([](auto& r) { r.set_target_path(std::string("/t\0x", 4)); }),
       IA, "NUL"},
      {"unpublish/no volume id", unpublish("", "/target"), IA, "volume_id is required"},
      {"unpublish/no target path", unpublish("v", ""), IA, "target_path is required"},
      {"stats/no volume id", stats("", "/target"), IA, "volume_id is required"},
      {"stats/no volume path", stats("v", ""), IA, "volume_path is required"},
  };
  for (const Case& c : cases) {
    grpc::Status s = c.call(this);
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.mentions), std::string::npos)
        << c.name << ": '" << s.error_message() << "' lacks '" << c.mentions << "'";
  }
}

TEST_F(CsiServerTest, ValidMountRequestsSayMountingIsNotBuiltAndExpandIsUnsupported) {
  csi::v1::NodePublishVolumeRequest r;
  r.set_volume_id("v");
  r.set_target_path("/target");
  *r.mutable_volume_capability() = MountCapability();
  csi::v1::NodePublishVolumeResponse resp;
  auto ctx = Ctx();
  grpc::Status s = node_->NodePublishVolume(ctx.get(), r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);

  csi::v1::NodeExpandVolumeRequest e;
  e.set_volume_id("v");
  e.set_volume_path("/target");
  csi::v1::NodeExpandVolumeResponse eresp;
  auto ctx2 = Ctx();
  s = node_->NodeExpandVolume(ctx2.get(), e, &eresp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(CsiServerTest, SecretsAndMountFlagsNeverReachTheLog) {
  FLAGS_v = 3;  // the most verbose logging the agent has
  LogCapture sink;
  csi::v1::NodeStageVolumeRequest stage;
  stage.set_volume_id("vol-visible");
  stage.set_staging_target_path("/stage");
  *stage.mutable_volume_capability() = MountCapability();
  stage.mutable_volume_capability()->mutable_mount()->add_mount_flags("password=FLAG_SECRET_1");
  (*stage.mutable_secrets())["token"] = "STAGE_SECRET_2";
  csi::v1::NodeStageVolumeResponse sresp;
  auto ctx = Ctx();
  node_->NodeStageVolume(ctx.get(), stage, &sresp);

  csi::v1::NodePublishVolumeRequest pub;
  pub.set_volume_id("vol-visible");
  pub.set_target_path("/target");
  *pub.mutable_volume_capability() = MountCapability();
  (*pub.mutable_secrets())["token"] = "PUBLISH_SECRET_3";
  csi::v1::NodePublishVolumeResponse presp;
  auto ctx2 = Ctx();
  node_->NodePublishVolume(ctx2.get(), pub, &presp);
  // An invalid request with secrets still logs safely.
  pub.clear_volume_id();
  auto ctx3 = Ctx();
  node_->NodePublishVolume(ctx3.get(), pub, &presp);
  FLAGS_v = 0;

  const std::string log = sink.text();
  EXPECT_NE(log.find("vol-visible"), std::string::npos) << log;  // requests are logged...
  for (const char* secret : {"FLAG_SECRET_1", "STAGE_SECRET_2", "PUBLISH_SECRET_3"}) {
    EXPECT_EQ(log.find(secret), std::string::npos) << secret << " leaked:\n" << log;
  }
}

TEST_F(CsiServerTest, ShutdownRemovesTheSocketAndRefusesNewConnections) {
  const std::string path = server_->socket_path();
  server_->Shutdown(absl::Seconds(5));
  server_.reset();
  EXPECT_NE(access(path.c_str(), F_OK), 0);
}

TEST_F(CsiServerTest, ManyConcurrentClientsAllAnswered) {
  constexpr int kThreads = 8, kCalls = 200;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kCalls; ++i) {
        csi::v1::NodeGetInfoResponse resp;
        auto ctx = Ctx();
        if (node_->NodeGetInfo(ctx.get(), {}, &resp).ok() && resp.node_id() == "node-a") ok++;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), kThreads * kCalls);
}

// Holds the loop thread hostage so that an RPC is provably in flight (queued for the loop).
struct LoopHostage {
  std::promise<void> held;
  std::promise<void> release;
  void Take(Loop& loop) {
    ASSERT_TRUE(loop.Post([this] {
      held.set_value();
      release.get_future().wait();
    }));
    ASSERT_EQ(held.get_future().wait_for(kTestDeadline), std::future_status::ready);
  }
};

// Sends NodeGetVolumeStats (answered on the loop; this server has no volumes, so its own answer
// is UNIMPLEMENTED) from another thread while the loop is held, and returns once the server has
// it in flight (queued for the loop).
std::future<grpc::Status> SendRpcBehindHostage(CsiServerTest* t) {
  auto rpc = std::async(std::launch::async, [t] {
    csi::v1::NodeGetVolumeStatsRequest req;
    req.set_volume_id("v");
    req.set_volume_path("/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/v/mount");
    csi::v1::NodeGetVolumeStatsResponse resp;
    auto ctx = t->Ctx();
    return t->node_->NodeGetVolumeStats(ctx.get(), req, &resp);
  });
  EXPECT_TRUE(t->server_->AwaitInFlightRpcsForTest(1, absl::FromChrono(kTestDeadline)));
  return rpc;
}

TEST_F(CsiServerTest, ShutdownLetsAnInFlightRpcFinishWithinGrace) {
  LoopHostage hostage;
  hostage.Take(lt_.loop());
  std::future<grpc::Status> rpc = SendRpcBehindHostage(this);
  auto shutdown = std::async(std::launch::async,
                             [&] { server_->Shutdown(absl::FromChrono(kTestDeadline)); });
  // Shutdown waits for the in-flight RPC; once the loop is free it completes normally.
  hostage.release.set_value();
  ASSERT_EQ(shutdown.wait_for(kTestDeadline), std::future_status::ready);
  ASSERT_EQ(rpc.wait_for(kTestDeadline), std::future_status::ready);
  grpc::Status status = rpc.get();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << "its own answer: " << status.error_message();
}

TEST_F(CsiServerTest, ShutdownCancelsRpcsStillInFlightAfterGrace) {
  LoopHostage hostage;
  hostage.Take(lt_.loop());
  std::future<grpc::Status> rpc = SendRpcBehindHostage(this);
  server_->Shutdown(absl::Milliseconds(20));  // returns although the loop is still held
  ASSERT_EQ(rpc.wait_for(kTestDeadline), std::future_status::ready);
  grpc::Status status = rpc.get();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  hostage.release.set_value();  // the late loop-side reply must be a harmless no-op
  lt_.RunOnLoop([] {});
}

TEST_F(CsiServerTest, ShutdownDoesNotWaitForAClientStuckBeforeTheHandshake) {
  UniqueFd raw(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  strncpy(addr.sun_path, server_->socket_path().c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(connect(raw.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  auto shutdown = std::async(std::launch::async, [&] { server_->Shutdown(absl::Seconds(60)); });
  // No RPC is in flight, so the 60 s grace must not be used up waiting for this connection.
  ASSERT_EQ(shutdown.wait_for(kTestDeadline), std::future_status::ready);
}

TEST(CsiServerStartTest, RefusesAnEndpointThatIsNotASocket) {
  ShortTempDir dir;
  LoopThread lt;
  const std::string file = dir.path() + "/csi.sock";
  FILE* f = fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  fputs("not a socket", f);
  fclose(f);
  CsiServerOptions options;
  options.endpoint = "unix://" + file;
  auto server = CsiServer::Start(lt.loop(), options);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition);
  struct stat st;
  ASSERT_EQ(stat(file.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
}

}  // namespace
}  // namespace fusekeeper
