// The agent run the way the DaemonSet runs it: its own root filesystem (an overlay, as a
// container image is), the node's / at /host, and the kubelet dir, state dir and socket dir
// bound in from the node (the kubelet dir Bidirectional). hostPath volumes must land on the node.
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "proto/csi.grpc.pb.h"
#include "tests/testing/csi_client.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/mount_fixture.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;
using namespace csi::v1;

class ContainerRootTest : public ::testing::Test {
 protected:
  void SetUp() override {
    struct statfs sf{};
    ASSERT_EQ(statfs("/", &sf), 0);
    if (static_cast<long>(sf.f_type) == 0x794c7630) GTEST_SKIP() << "the test itself runs in an overlay root";
    node_ = root_.path() + "/node";          // stands for the node's own directories
    kubelet_ = node_ + "/var/lib/kubelet";
    state_ = node_ + "/var/lib/fusekeeper";
    sockets_ = node_ + "/plugins";
    for (const auto& d : {kubelet_ + "/pods", state_, sockets_}) fs::create_directories(d);
    // As on a node: the kubelet dir is an rshared mount.
    ASSERT_EQ(mount(kubelet_.c_str(), kubelet_.c_str(), nullptr, MS_BIND, nullptr), 0);
    ASSERT_EQ(mount(nullptr, kubelet_.c_str(), nullptr, MS_SHARED | MS_REC, nullptr), 0);
    char real[PATH_MAX];
    ASSERT_NE(realpath(RunfilePath("agent/fusekeeper").c_str(), real), nullptr);
    agent_bin_ = real;
  }
  void TearDown() override {
    if (agent_) {
      agent_->Signal(SIGTERM);
      agent_->Wait(std::chrono::milliseconds(20000));
    }
  }
  // The agent in a mount namespace of its own whose root is an overlay over the node's /; with
  // `host_root`, the node's / is bound at /host as the DaemonSet does.
  std::unique_ptr<Subprocess> StartInContainer(bool host_root) {
    const std::string c = root_.path() + "/container";
    const std::string m = c + "/merged";
    std::string script = "set -e; mkdir -p " + c + "/upper " + c + "/work " + m +
                         "; mount -t tmpfs img " + c + " && mkdir -p " + c + "/upper " + c + "/work " + m +
                         "; mount -t overlay image -o lowerdir=/,upperdir=" + c + "/upper,workdir=" + c + "/work " + m +
                         "; mkdir -p " + m + kubelet_ + " " + m + state_ + " " + m + sockets_ +
                         "; mount --rbind " + kubelet_ + " " + m + kubelet_ +      // Bidirectional
                         "; mount --bind " + state_ + " " + m + state_ +
                         "; mount --bind " + sockets_ + " " + m + sockets_ +
                         // What a runtime gives every container.
                         "; mount -t proc proc " + m + "/proc; mount --rbind /dev " + m + "/dev; mount --rbind /sys " + m + "/sys";
    if (host_root) {
      script += "; mkdir -p " + m + "/host; mount --rbind / " + m + "/host; mount --make-rslave " + m + "/host";
    }
    script += "; exec chroot " + m + " " + agent_bin_ + " --endpoint=unix://" + sockets_ +
              "/csi.sock --node_id=n --kubelet_dir=" + kubelet_ + " --state_dir=" + state_ +
              " --state_lock_wait_ms=0" + (host_root ? " --host_root=/host" : "");
    return std::make_unique<Subprocess>(
        std::vector<std::string>{"/usr/bin/unshare", "-m", "--propagation", "unchanged", "/bin/sh", "-c", script});
  }

  TmpfsDir root_;
  std::string node_, kubelet_, state_, sockets_, agent_bin_;
  std::unique_ptr<Subprocess> agent_;
};

TEST_F(ContainerRootTest, WithoutAHostRootTheAgentRefusesToStart) {
  auto agent = StartInContainer(/*host_root=*/false);
  auto status = agent->Wait(std::chrono::milliseconds(20000));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 2) << agent->Stderr();
  EXPECT_NE(agent->Stderr().find("the agent's root filesystem is an overlay"), std::string::npos) << agent->Stderr();
}

TEST_F(ContainerRootTest, HostPathVolumesLandOnTheNode) {
  agent_ = StartInContainer(/*host_root=*/true);
  auto channel = DialUnixSocket(sockets_ + "/csi.sock");
  ASSERT_TRUE(agent_->WaitForStderr("CSI server listening", 1, std::chrono::milliseconds(20000))) << agent_->Stderr();
  ASSERT_TRUE(WaitForReadyAgent(channel, std::chrono::steady_clock::now() + kTestDeadline)) << agent_->Stderr();
  auto node = Node::NewStub(channel);
  // A DirectoryOrCreate path on the node (in the container's image it would be a fresh copy).
  const std::string data = node_ + "/srv/data";
  const std::string staging = kubelet_ + "/plugins/kubernetes.io/csi/fusekeeper.csi/hp/globalmount";
  const std::string target = kubelet_ + "/pods/p/volumes/kubernetes.io~csi/hp/mount";
  fs::create_directories(staging);
  fs::create_directories(target.substr(0, target.rfind('/')));
  {
    NodeStageVolumeRequest r;
    r.set_volume_id("hp");
    r.set_staging_target_path(staging);
    *r.mutable_volume_capability() = MountCapability();
    (*r.mutable_volume_context())["kind"] = "hostPath";
    (*r.mutable_volume_context())["path"] = data;
    (*r.mutable_volume_context())["type"] = "DirectoryOrCreate";
    NodeStageVolumeResponse resp;
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + kTestDeadline);
    grpc::Status s = node->NodeStageVolume(&c, r, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message() << agent_->Stderr();
  }
  EXPECT_TRUE(fs::is_directory(data)) << "created on the node, not in the container's image";
  {
    NodePublishVolumeRequest r;
    r.set_volume_id("hp");
    r.set_staging_target_path(staging);
    r.set_target_path(target);
    *r.mutable_volume_capability() = MountCapability();
    NodePublishVolumeResponse resp;
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + kTestDeadline);
    grpc::Status s = node->NodePublishVolume(&c, r, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  // The pod writes through its target (seen from the node, as kubelet sees it): the data is on the node.
  { std::ofstream(target + "/written-by-pod") << "kept"; }
  std::ifstream in(data + "/written-by-pod");
  std::string got;
  in >> got;
  EXPECT_EQ(got, "kept");
}

}  // namespace
}  // namespace fusekeeper
