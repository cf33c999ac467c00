// The FUSE end-to-end fixture: the real agent binary and the real reference server (fkserve, run
// unprivileged as uid 65534) in the test's private mount namespace, with a real /dev/fuse.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>

#include "absl/strings/match.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/volume/state_store.h"
#include "gtest/gtest.h"
#include "proto/csi.grpc.pb.h"
#include "tests/testing/csi_client.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/mount_fixture.h"
#include "tests/testing/no_io_uring.h"
#include "tests/testing/fake_kube.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/with_deadline.h"
#include "tests/volume/pod_reader.h"

namespace fusekeeper {

using namespace csi::v1;
namespace fs = std::filesystem;
constexpr uid_t kServerUid = 65534;

// GET http://127.0.0.1:<port><path> with a plain socket; the whole response.
inline std::string HttpGet(int port, const std::string& path) {
  UniqueFd s(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return "connect failed";
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  if (write(s.get(), req.data(), req.size()) < 0) return "write failed";
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(s.get(), buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// Waits (on POLLPRI from /proc/self/mountinfo, no sleeping) until `path` has `n` mounts.
inline bool WaitForMountCount(const std::string& path, int n) {
  UniqueFd fd(open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC));
  auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
  while (MountCountAt(path) != n) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd.get(), POLLPRI, 0};
    poll(&p, 1, static_cast<int>(left.count()));
    char buf[4096];
    lseek(fd.get(), 0, SEEK_SET);
    while (read(fd.get(), buf, sizeof(buf)) > 0) {
    }
  }
  return true;
}

class FuseE2ETest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access("/dev/fuse", R_OK | W_OK) != 0) GTEST_SKIP() << "no /dev/fuse";
    kubelet_ = root_.path() + "/kubelet";
    state_ = root_.path() + "/state";
    export_ = root_.path() + "/export";
    fs::create_directories(kubelet_ + "/pods");
    fs::create_directories(export_);
    // As on a real node, the kubelet dir is an rshared mount: what is mounted below it propagates
    // into the containers' copies of pod targets (see PodReader).
    ASSERT_EQ(mount(kubelet_.c_str(), kubelet_.c_str(), nullptr, MS_BIND, nullptr), 0) << strerror(errno);
    ASSERT_EQ(mount(nullptr, kubelet_.c_str(), nullptr, MS_SHARED | MS_REC, nullptr), 0) << strerror(errno);
    chmod(root_.path().c_str(), 0755);
    chown(export_.c_str(), kServerUid, kServerUid);
    { std::ofstream(export_ + "/hello.txt") << "hello from the export\n"; }
    chown((export_ + "/hello.txt").c_str(), kServerUid, kServerUid);
    // The unprivileged server needs a copy of its binary outside /root.
    fkserve_ = root_.path() + "/fkserve";
    fs::copy_file(RunfilePath("agent/fkserve/fkserve"), fkserve_);
    chmod(fkserve_.c_str(), 0755);
    // The launcher's fusermount and preload library go beside it (it looks for them there).
    for (const char* beside : {"libfkserve_preload.so", "fkserve-fusermount"}) {
      fs::copy_file(RunfilePath(std::string("agent/fkserve/") + beside), root_.path() + "/" + beside);
      chmod((root_.path() + "/" + beside).c_str(), 0755);
    }
  }
  void TearDown() override {
    for (auto& s : servers_) s->Signal(SIGKILL);
    servers_.clear();
    if (agent_) {
      agent_->Signal(SIGTERM);
      agent_->Wait(std::chrono::milliseconds(20000));
    }
  }

  void StartAgent(std::vector<std::string> extra = {}) {
    std::vector<std::string> cmd = agent_prefix_;
    std::vector<std::string> agent = {RunfilePath("agent/fusekeeper"), "--endpoint=unix://" + root_.path() + "/csi.sock",
                                    "--node_id=n", "--kubelet_dir=" + kubelet_, "--state_dir=" + state_,
                                    "--stats_timeout_ms=1000",
                                    // Off unless a test is about it (it polls the API server).
                                    "--readiness_taint="};
    agent.insert(agent.end(), extra.begin(), extra.end());
    cmd.insert(cmd.end(), agent.begin(), agent.end());
    agent_ = std::make_unique<Subprocess>(cmd, agent_env_);
    channel_ = DialUnixSocket(root_.path() + "/csi.sock");
    ASSERT_TRUE(channel_->WaitForConnected(std::chrono::system_clock::now() + kTestDeadline)) << agent_->Stderr();
    node_ = Node::NewStub(channel_);
    ASSERT_TRUE(WaitForReadyAgent(channel_, std::chrono::steady_clock::now() + kTestDeadline))
        << agent_->Stderr();
  }
  Subprocess* StartServer(const std::string& socket, std::vector<std::string> mode = {}) {
    if (mode.empty()) mode = {"serve", "--root=" + export_};
    std::vector<std::string> cmd = {fkserve_, "--socket=" + socket};
    cmd.insert(cmd.end(), mode.begin(), mode.end());
    const bool no_ring = servers_refuse_io_uring_;
    servers_.push_back(std::make_unique<Subprocess>(cmd, std::vector<std::string>{}, [no_ring] {
      if (setresgid(kServerUid, kServerUid, kServerUid) != 0 || setresuid(kServerUid, kServerUid, kServerUid) != 0) {
        _exit(99);
      }
      if (no_ring && !RefuseIoUring()) _exit(98);
    }));
    return servers_.back().get();
  }

  // Reads `file` under pod target `target` from a container-like view (pod_reader.h), made when
  // the reader starts: wait for its first reads before changing the target's mounts.
  std::unique_ptr<Reader> PodReader(const std::string& target, const std::string& file) {
    const std::string view = root_.path() + "/views/" + std::to_string(views_++);
    fs::create_directories(view);
    return Reader::InPod(target, file, view);
  }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + kTestDeadline);
    return c;
  }
  std::map<std::string, std::string> FuseContext() {
    std::map<std::string, std::string> c = {{"kind", "fuse"}, {"serverUid", std::to_string(kServerUid)}, {"bucket", "demo"}};
    c.insert(extra_context_.begin(), extra_context_.end());
    return c;
  }
  // A pod with an emptyDir "fk" for the handoff socket; returns its target path for volume `vol`.
  std::string Pod(const std::string& uid, const std::string& vol) {
    fs::create_directories(kubelet_ + "/pods/" + uid + "/volumes/kubernetes.io~empty-dir/fk");
    chmod((kubelet_ + "/pods/" + uid + "/volumes/kubernetes.io~empty-dir/fk").c_str(), 0777);
    fs::create_directories(kubelet_ + "/pods/" + uid + "/volumes/kubernetes.io~csi/" + vol);
    return kubelet_ + "/pods/" + uid + "/volumes/kubernetes.io~csi/" + vol + "/mount";
  }
  std::string PodSocket(const std::string& uid) {
    return kubelet_ + "/pods/" + uid + "/volumes/kubernetes.io~empty-dir/fk/fusekeeper.sock";
  }
  grpc::Status PublishInline(const std::string& id, const std::string& pod, const std::string& target,
                             bool readonly = false, const std::string& fs_group = "",
                             std::vector<std::string> flags = {}) {
    NodePublishVolumeRequest r;
    r.set_volume_id(id);
    r.set_target_path(target);
    r.set_readonly(readonly);
    *r.mutable_volume_capability() = MountCapability();
    r.mutable_volume_capability()->mutable_mount()->set_volume_mount_group(fs_group);
    for (const auto& f : flags) r.mutable_volume_capability()->mutable_mount()->add_mount_flags(f);
    for (const auto& [k, v] : FuseContext()) (*r.mutable_volume_context())[k] = v;
    (*r.mutable_volume_context())["csi.storage.k8s.io/pod.uid"] = pod;
    (*r.mutable_volume_context())["csi.storage.k8s.io/ephemeral"] = "true";
    (*r.mutable_volume_context())["socketVolume"] = "fk";
    NodePublishVolumeResponse resp;
    auto c = Ctx();
    return node_->NodePublishVolume(c.get(), r, &resp);
  }
  // Staged FUSE volumes, as kubelet drives them: the global mount path of volume `id`, NodeStage
  // there, the handoff socket a node-level server connects to, NodePublish into a pod (with the
  // pod's identity, as podInfoOnMount gives it), and NodeUnstage.
  std::string StagingPath(const std::string& id) {
    const std::string staging = kubelet_ + "/plugins/kubernetes.io/csi/fusekeeper.csi/" + id + "/globalmount";
    fs::create_directories(staging);
    return staging;
  }
  grpc::Status StageFuse(const std::string& id, const std::string& staging, const std::string& fs_group = "",
                         const std::vector<std::string>& flags = {}) {
    NodeStageVolumeRequest r;
    r.set_volume_id(id);
    r.set_staging_target_path(staging);
    *r.mutable_volume_capability() = MountCapability();
    r.mutable_volume_capability()->mutable_mount()->set_volume_mount_group(fs_group);
    for (const auto& f : flags) r.mutable_volume_capability()->mutable_mount()->add_mount_flags(f);
    for (const auto& [k, v] : FuseContext()) (*r.mutable_volume_context())[k] = v;
    NodeStageVolumeResponse resp;
    auto c = Ctx();
    return node_->NodeStageVolume(c.get(), r, &resp);
  }
  std::string StagedSocket(const std::string& id) {
    return state_ + "/sockets/" + Sha256Hex(id).substr(0, 32) + ".sock";
  }
  grpc::Status PublishStaged(const std::string& id, const std::string& staging, const std::string& target,
                             const std::string& pod_name = "", const std::string& pod_uid = "",
                             const std::string& fs_group = "", const std::vector<std::string>& flags = {}) {
    NodePublishVolumeRequest r;
    r.set_volume_id(id);
    r.set_staging_target_path(staging);
    r.set_target_path(target);
    *r.mutable_volume_capability() = MountCapability();
    r.mutable_volume_capability()->mutable_mount()->set_volume_mount_group(fs_group);
    for (const auto& f : flags) r.mutable_volume_capability()->mutable_mount()->add_mount_flags(f);
    if (!pod_name.empty()) {
      (*r.mutable_volume_context())["csi.storage.k8s.io/pod.name"] = pod_name;
      (*r.mutable_volume_context())["csi.storage.k8s.io/pod.namespace"] = "default";
      (*r.mutable_volume_context())["csi.storage.k8s.io/pod.uid"] = pod_uid;
    }
    NodePublishVolumeResponse resp;
    auto c = Ctx();
    return node_->NodePublishVolume(c.get(), r, &resp);
  }
  grpc::Status Unstage(const std::string& id, const std::string& staging) {
    NodeUnstageVolumeRequest r;
    r.set_volume_id(id);
    r.set_staging_target_path(staging);
    NodeUnstageVolumeResponse resp;
    auto c = Ctx();
    return node_->NodeUnstageVolume(c.get(), r, &resp);
  }
  // Retries ABORTED (an operation on the volume in flight), as kubelet does.
  grpc::Status Unpublish(const std::string& id, const std::string& target) {
    NodeUnpublishVolumeRequest r;
    r.set_volume_id(id);
    r.set_target_path(target);
    auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
    while (true) {
      NodeUnpublishVolumeResponse resp;
      auto c = Ctx();
      grpc::Status s = node_->NodeUnpublishVolume(c.get(), r, &resp);
      if (s.error_code() != grpc::ABORTED || std::chrono::steady_clock::now() > deadline) return s;
    }
  }
  NodeGetVolumeStatsResponse Stats(const std::string& id, const std::string& path) {
    NodeGetVolumeStatsRequest r;
    r.set_volume_id(id);
    r.set_volume_path(path);
    NodeGetVolumeStatsResponse resp;
    auto c = Ctx();
    grpc::Status s = node_->NodeGetVolumeStats(c.get(), r, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  // The API server (and kubelet) double, with the agent's service account secrets for it in
  // secrets_ and the in-cluster environment set for the next StartAgent.
  FakeKube& StartKube() {
    const std::string kube_dir = root_.path() + "/kube";
    fs::create_directories(kube_dir);
    kube_ = std::make_unique<FakeKube>(kube_dir);
    EXPECT_TRUE(kube_->ok()) << kube_->Diagnostics();
    secrets_ = root_.path() + "/secrets";
    fs::create_directories(secrets_);
    fs::copy_file(kube_->ca_file(), secrets_ + "/ca.crt", fs::copy_options::overwrite_existing);
    { std::ofstream(secrets_ + "/token") << "agent-token"; }
    agent_env_ = {"KUBERNETES_SERVICE_HOST=127.0.0.1", "KUBERNETES_SERVICE_PORT=" + std::to_string(kube_->port())};
    return *kube_;
  }

  TmpfsDir root_;
  std::string kubelet_, state_, export_, fkserve_, secrets_;
  std::unique_ptr<FakeKube> kube_;
  std::unique_ptr<Subprocess> agent_;
  std::vector<std::string> agent_env_;  // extra environment for the agent
  std::map<std::string, std::string> extra_context_;  // more volume_context for every volume
  std::vector<std::string> agent_prefix_;  // a command the agent is run under (e.g. unshare)
  std::vector<std::unique_ptr<Subprocess>> servers_;
  // Servers run under a seccomp filter that refuses io_uring, as under containerd 2.0's, Docker
  // 25's or CRI-O's default profile (FUSEKEEPER_NO_IO_URING=1 runs a whole suite that way).
  bool servers_refuse_io_uring_ = [] {
    const char* env = getenv(kNoIoUringEnv);
    return env != nullptr && env[0] == '1';
  }();
  int views_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Node::Stub> node_;
};

}  // namespace fusekeeper
