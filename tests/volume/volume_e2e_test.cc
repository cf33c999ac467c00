// The real agent binary in this test's private mount namespace, driven over its socket the way
// kubelet drives it: host-path volumes staged, published, read and written through the targets,
// unpublished and unstaged; idempotency and conflicts; escapes; every host-path type; kill -9
// between mount steps and restart; concurrent RPCs on many volumes.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <algorithm>
#include <future>
#include <thread>

#include "absl/strings/match.h"
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

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

class VolumeE2ETest : public ::testing::Test {
 protected:
  void SetUp() override {
    kubelet_ = root_.path() + "/kubelet";
    state_ = root_.path() + "/state";
    sock_ = root_.path() + "/csi.sock";
    fs::create_directories(kubelet_ + "/pods");
    fs::create_directories(kubelet_ + "/plugins");
    StartAgent();
  }
  void TearDown() override { StopAgent(); }

  void StartAgent(std::vector<std::string> env = {}, bool allow_ephemeral = true) {
    std::vector<std::string> cmd = {RunfilePath("agent/fusekeeper"), "--endpoint=unix://" + sock_,
                                    "--node_id=n", "--kubelet_dir=" + kubelet_,
                                    "--state_dir=" + state_, "--stats_timeout_ms=3000"};
    if (allow_ephemeral) cmd.push_back("--ephemeral_host_path_prefixes=" + host_.path() + "/types");
    agent_ = std::make_unique<Subprocess>(cmd, env);
    channel_ = DialUnixSocket(sock_);
    ASSERT_TRUE(channel_->WaitForConnected(std::chrono::system_clock::now() + kTestDeadline))
        << agent_->Stderr();
    node_ = Node::NewStub(channel_);
    // Ready once saved state is reconciled.
    ASSERT_TRUE(WaitForReadyAgent(channel_, std::chrono::steady_clock::now() + kTestDeadline))
        << agent_->Stderr();
  }
  void StopAgent() {
    if (!agent_) return;
    agent_->Signal(SIGTERM);
    agent_->Wait(std::chrono::milliseconds(20000));
    agent_.reset();
  }
  // An agent started with a crash point dies at it; returns once it has.
  void ExpectAgentKilled() {
    auto status = agent_->Wait(std::chrono::milliseconds(20000));
    ASSERT_TRUE(status.has_value());
    EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL) << agent_->Stderr();
    agent_.reset();
  }

  std::string Staging(const std::string& vol) {
    std::string p = kubelet_ + "/plugins/kubernetes.io/csi/fusekeeper.csi/" + vol + "/globalmount";
    fs::create_directories(p);  // kubelet creates it before NodeStageVolume
    return p;
  }
  std::string Target(const std::string& pod, const std::string& vol) {
    std::string dir = kubelet_ + "/pods/" + pod + "/volumes/kubernetes.io~csi/" + vol;
    fs::create_directories(dir);  // kubelet creates the parent; the plugin creates `mount`
    return dir + "/mount";
  }
  std::string HostDir(const std::string& name) {
    std::string p = host_.path() + "/" + name;
    fs::create_directories(p);
    return p;
  }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + kTestDeadline);
    return c;
  }
  grpc::Status Stage(const std::string& id, const std::string& staging, const std::string& path,
                     const std::string& type = "Directory", std::vector<std::string> flags = {}) {
    NodeStageVolumeRequest r;
    r.set_volume_id(id);
    r.set_staging_target_path(staging);
    *r.mutable_volume_capability() = MountCapability();
    for (auto& f : flags) r.mutable_volume_capability()->mutable_mount()->add_mount_flags(f);
    (*r.mutable_volume_context())["kind"] = "hostPath";
    (*r.mutable_volume_context())["path"] = path;
    (*r.mutable_volume_context())["type"] = type;
    NodeStageVolumeResponse resp;
    auto c = Ctx();
    return node_->NodeStageVolume(c.get(), r, &resp);
  }
  grpc::Status Publish(const std::string& id, const std::string& staging, const std::string& target,
                       bool readonly = false, const std::string& host = "",
                       const std::string& type = "") {
    NodePublishVolumeRequest r;
    r.set_volume_id(id);
    r.set_staging_target_path(staging);
    r.set_target_path(target);
    r.set_readonly(readonly);
    *r.mutable_volume_capability() = MountCapability();
    if (!host.empty()) {
      (*r.mutable_volume_context())["kind"] = "hostPath";
      (*r.mutable_volume_context())["path"] = host;
      (*r.mutable_volume_context())["type"] = type;
    }
    NodePublishVolumeResponse resp;
    auto c = Ctx();
    return node_->NodePublishVolume(c.get(), r, &resp);
  }
  grpc::Status Unpublish(const std::string& id, const std::string& target) {
    NodeUnpublishVolumeRequest r;
    r.set_volume_id(id);
    r.set_target_path(target);
    NodeUnpublishVolumeResponse resp;
    auto c = Ctx();
    return node_->NodeUnpublishVolume(c.get(), r, &resp);
  }
  grpc::Status Unstage(const std::string& id, const std::string& staging) {
    NodeUnstageVolumeRequest r;
    r.set_volume_id(id);
    r.set_staging_target_path(staging);
    NodeUnstageVolumeResponse resp;
    auto c = Ctx();
    return node_->NodeUnstageVolume(c.get(), r, &resp);
  }
  grpc::Status Stats(const std::string& id, const std::string& path, NodeGetVolumeStatsResponse* resp) {
    NodeGetVolumeStatsRequest r;
    r.set_volume_id(id);
    r.set_volume_path(path);
    auto c = Ctx();
    return node_->NodeGetVolumeStats(c.get(), r, resp);
  }

  TmpfsDir root_;
  TmpfsDir host_;  // a separate file system, as a node's data disk would be
  std::string kubelet_, state_, sock_;
  std::unique_ptr<Subprocess> agent_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Node::Stub> node_;
};

TEST_F(VolumeE2ETest, StagePublishReadWriteUnpublishUnstage) {
  const std::string data = HostDir("data");
  { std::ofstream(data + "/hello.txt") << "from the host"; }
  const std::string staging = Staging("v1");
  const std::string t1 = Target("pod-a", "v1"), t2 = Target("pod-b", "v1");
  ASSERT_RPC_OK(Stage("v1", staging, data));
  EXPECT_EQ(MountCountAt(staging), 1);
  ASSERT_RPC_OK(Publish("v1", staging, t1));
  ASSERT_RPC_OK(Publish("v1", staging, t2, /*readonly=*/true));
  EXPECT_EQ(ReadFile(t1 + "/hello.txt"), "from the host");
  EXPECT_EQ(ReadFile(t2 + "/hello.txt"), "from the host");
  // Written through one pod's target, seen on the host and through the other pod's.
  { std::ofstream(t1 + "/from-pod.txt") << "written by pod a"; }
  EXPECT_EQ(ReadFile(data + "/from-pod.txt"), "written by pod a");
  EXPECT_EQ(ReadFile(t2 + "/from-pod.txt"), "written by pod a");
  // The read-only target refuses writes.
  int fd = open((t2 + "/nope").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
  EXPECT_LT(fd, 0);
  EXPECT_EQ(errno, EROFS);

  ASSERT_RPC_OK(Unpublish("v1", t1));
  EXPECT_EQ(MountCountAt(t1), 0);
  EXPECT_FALSE(fs::exists(t1)) << "unpublish removes the target it created";
  ASSERT_RPC_OK(Unpublish("v1", t2));
  ASSERT_RPC_OK(Unstage("v1", staging));
  EXPECT_EQ(MountCountAt(staging), 0);
  EXPECT_TRUE(fs::exists(data + "/from-pod.txt")) << "no data lost";
  EXPECT_TRUE(fs::is_empty(state_ + "/volumes"));
}

TEST_F(VolumeE2ETest, RepeatsAreIdempotentAndConflictsAreAlreadyExists) {
  const std::string data = HostDir("d"), other = HostDir("other");
  const std::string staging = Staging("v"), target = Target("p", "v");
  ASSERT_RPC_OK(Stage("v", staging, data));
  ASSERT_RPC_OK(Stage("v", staging, data));
  EXPECT_EQ(MountCountAt(staging), 1) << "a repeated stage must not mount twice";
  EXPECT_EQ(Stage("v", staging, other).error_code(), grpc::ALREADY_EXISTS);
  EXPECT_EQ(Stage("v", Staging("elsewhere"), data).error_code(), grpc::ALREADY_EXISTS);

  ASSERT_RPC_OK(Publish("v", staging, target));
  ASSERT_RPC_OK(Publish("v", staging, target));
  EXPECT_EQ(MountCountAt(target), 1) << "a repeated publish must not mount twice";
  EXPECT_EQ(Publish("v", staging, target, /*readonly=*/true).error_code(), grpc::ALREADY_EXISTS);

  ASSERT_RPC_OK(Unpublish("v", target));
  ASSERT_RPC_OK(Unpublish("v", target));
  ASSERT_RPC_OK(Unstage("v", staging));
  ASSERT_RPC_OK(Unstage("v", staging));
  EXPECT_EQ(MountCountAt(staging), 0);
}

TEST_F(VolumeE2ETest, NotFoundAndPreconditionErrors) {
  const std::string data = HostDir("d");
  const std::string staging = Staging("v"), target = Target("p", "v");
  EXPECT_EQ(Publish("ghost", staging, target).error_code(), grpc::NOT_FOUND);
  NodeGetVolumeStatsResponse stats;
  EXPECT_EQ(Stats("ghost", target, &stats).error_code(), grpc::NOT_FOUND);
  ASSERT_RPC_OK(Stage("v", staging, data));
  EXPECT_EQ(Stats("v", target, &stats).error_code(), grpc::NOT_FOUND) << "not published there";
  ASSERT_RPC_OK(Publish("v", staging, target));
  EXPECT_EQ(Unstage("v", staging).error_code(), grpc::FAILED_PRECONDITION) << "still published";
  EXPECT_EQ(Stage("v", staging, data, "Directory", {"password=s3cret"}).error_code(),
            grpc::INVALID_ARGUMENT);
  ASSERT_RPC_OK(Unpublish("v", target));
  ASSERT_RPC_OK(Unstage("v", staging));
  EXPECT_EQ(agent_->Stderr().find("s3cret"), std::string::npos) << "mount flags are never logged";
}

TEST_F(VolumeE2ETest, VolumeStatsAndConditionWhenTheMountDisappears) {
  const std::string data = HostDir("d");
  const std::string staging = Staging("v"), target = Target("p", "v");
  ASSERT_RPC_OK(Stage("v", staging, data));
  ASSERT_RPC_OK(Publish("v", staging, target));
  NodeGetVolumeStatsResponse resp;
  ASSERT_RPC_OK(Stats("v", target, &resp));
  ASSERT_EQ(resp.usage_size(), 2);
  EXPECT_EQ(resp.usage(0).unit(), VolumeUsage::BYTES);
  EXPECT_GT(resp.usage(0).total(), 0);
  EXPECT_EQ(resp.usage(1).unit(), VolumeUsage::INODES);
  EXPECT_GT(resp.usage(1).total(), 0);
  EXPECT_FALSE(resp.volume_condition().abnormal());
  ASSERT_RPC_OK(Stats("v", staging, &resp));
  EXPECT_FALSE(resp.volume_condition().abnormal());

  ASSERT_EQ(umount2(target.c_str(), MNT_DETACH), 0);  // someone removes the mount behind our back
  ASSERT_RPC_OK(Stats("v", target, &resp));
  EXPECT_TRUE(resp.volume_condition().abnormal());
  EXPECT_NE(resp.volume_condition().message().find("not mounted"), std::string::npos)
      << resp.volume_condition().message();
  ASSERT_RPC_OK(Unpublish("v", target));
  ASSERT_RPC_OK(Unstage("v", staging));
}

TEST_F(VolumeE2ETest, PathsOutsideTheKubeletDirOrThroughSymlinksAreRefused) {
  const std::string data = HostDir("d");
  const std::string staging = Staging("v");
  ASSERT_RPC_OK(Stage("v", staging, data));
  const std::string outside = HostDir("victim");
  EXPECT_EQ(Publish("v", staging, outside + "/mount").error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(Publish("v", staging, kubelet_ + "/pods/../../victim/mount").error_code(),
            grpc::INVALID_ARGUMENT);
  // A symlink planted in the pod's volume dir, pointing out of the kubelet dir.
  fs::create_directories(kubelet_ + "/pods/evil/volumes/kubernetes.io~csi");
  fs::create_directory_symlink(outside, kubelet_ + "/pods/evil/volumes/kubernetes.io~csi/v");
  grpc::Status s = Publish("v", staging, kubelet_ + "/pods/evil/volumes/kubernetes.io~csi/v/mount");
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << s.error_message();
  EXPECT_FALSE(fs::exists(outside + "/mount")) << "nothing created outside";
  EXPECT_EQ(MountCountAt(outside + "/mount"), 0);
  // The target itself a symlink.
  const std::string tdir = kubelet_ + "/pods/evil2/volumes/kubernetes.io~csi/v";
  fs::create_directories(tdir);
  fs::create_directory_symlink(outside, tdir + "/mount");
  s = Publish("v", staging, tdir + "/mount");
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(MountCountAt(outside), 0);
  // hostPath with "..".
  EXPECT_EQ(Stage("w", Staging("w"), data + "/../d").error_code(), grpc::INVALID_ARGUMENT);
  ASSERT_RPC_OK(Unstage("v", staging));
}

// A path component swapped for a symlink between RPCs (after a good publish, before the next):
// the next RPC refuses it and creates nothing outside the kubelet dir.
TEST_F(VolumeE2ETest, SymlinksSwappedInBetweenRpcsAreRefused) {
  const std::string data = HostDir("d"), outside = HostDir("outside");
  const std::string staging = Staging("v"), target = Target("p", "v");
  ASSERT_RPC_OK(Stage("v", staging, data));
  ASSERT_RPC_OK(Publish("v", staging, target));
  ASSERT_RPC_OK(Unpublish("v", target));
  // The pod's volume directory is now a symlink to somewhere else.
  const std::string voldir = kubelet_ + "/pods/p/volumes/kubernetes.io~csi/v";
  fs::remove_all(voldir);
  fs::create_directory_symlink(outside, voldir);
  grpc::Status s = Publish("v", staging, target);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << s.error_message();
  EXPECT_FALSE(fs::exists(outside + "/mount"));
  EXPECT_EQ(MountCountAt(outside + "/mount"), 0);
  // The staging directory swapped too: unstaging refuses to follow it, and mounts nothing.
  const std::string real_staging = staging + ".real";
  ASSERT_EQ(umount2(staging.c_str(), MNT_DETACH), 0);
  fs::rename(staging, real_staging);
  fs::create_directory_symlink(outside, staging);
  s = Publish("v", staging, Target("p2", "v"));
  EXPECT_NE(s.error_code(), grpc::OK);
  EXPECT_EQ(MountCountAt(outside), 0) << "nothing mounted through the swapped symlink";
}

TEST_F(VolumeE2ETest, EveryHostPathTypeIncludingSocketsAndDevices) {
  const std::string base = HostDir("types");
  const std::string dir = base + "/dir", file = base + "/file", sock = base + "/sock",
                    chr = base + "/chr", blk = base + "/blk";
  fs::create_directories(dir);
  { std::ofstream(file) << "file content"; }
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  strncpy(a.sun_path, sock.c_str(), sizeof(a.sun_path) - 1);
  ASSERT_EQ(bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(s, 1), 0);
  ASSERT_EQ(mknod(chr.c_str(), S_IFCHR | 0666, makedev(1, 3)), 0);  // /dev/null
  ASSERT_EQ(mknod(blk.c_str(), S_IFBLK | 0600, makedev(7, 0)), 0);

  struct Row {
    std::string path, type;
  };
  std::vector<Row> rows = {{dir, "Directory"},   {file, "File"},      {sock, "Socket"},
                           {chr, "CharDevice"}, {blk, "BlockDevice"}, {base + "/new-dir", "DirectoryOrCreate"},
                           {base + "/new/file", "FileOrCreate"},      {dir, ""}};
  int n = 0;
  for (const Row& row : rows) {
    const std::string id = "t" + std::to_string(n++);
    // Ephemeral style: published straight from the host path.
    const std::string target = Target("p-" + id, id);
    grpc::Status st = Publish(id, "", target, false, row.path, row.type);
    ASSERT_TRUE(st.ok()) << row.type << " " << row.path << ": " << st.error_message();
    struct stat got, want;
    ASSERT_EQ(stat(target.c_str(), &got), 0);
    ASSERT_EQ(stat(row.path.c_str(), &want), 0);
    EXPECT_EQ(got.st_ino, want.st_ino) << row.type << ": the target is the host object";
    EXPECT_EQ(got.st_mode & S_IFMT, want.st_mode & S_IFMT);
    // Staged style too.
    const std::string sid = "s" + id;
    ASSERT_RPC_OK(Stage(sid, Staging(sid), row.path, row.type));
    const std::string starget = Target("ps-" + id, sid);
    ASSERT_RPC_OK(Publish(sid, Staging(sid), starget));
    ASSERT_EQ(stat(starget.c_str(), &got), 0);
    EXPECT_EQ(got.st_ino, want.st_ino) << row.type << " (staged)";
    ASSERT_RPC_OK(Unpublish(sid, starget));
    ASSERT_RPC_OK(Unstage(sid, Staging(sid)));
    ASSERT_RPC_OK(Unpublish(id, target));
    EXPECT_FALSE(fs::exists(target));
  }
  EXPECT_EQ(ReadFile(file), "file content");
  // Wrong types say what was expected and found; nothing is mounted.
  const std::string target = Target("p-wrong", "wrong");
  grpc::Status st = Publish("wrong", "", target, false, file, "Directory");
  EXPECT_EQ(st.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("is a regular file, but type Directory expects a directory"),
            std::string::npos)
      << st.error_message();
  st = Publish("wrong", "", target, false, chr, "BlockDevice");
  EXPECT_NE(st.error_message().find("is a character device, but type BlockDevice expects a block device"),
            std::string::npos)
      << st.error_message();
  EXPECT_EQ(Publish("wrong", "", target, false, base + "/missing", "File").error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(Publish("wrong", "", target, false, dir, "Bogus").error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(MountCountAt(target), 0);
  close(s);
}

// Unstaged hostPath volumes are chosen by pod authors: only below --ephemeral_host_path_prefixes,
// judged on the real path of what was opened.
TEST_F(VolumeE2ETest, EphemeralHostPathsAreConfinedToTheAllowedPrefixes) {
  const std::string allowed = HostDir("types");
  const std::string outside = HostDir("secret");
  { std::ofstream(outside + "/key") << "secret"; }
  const std::string target = Target("p", "e");
  grpc::Status s = Publish("e", "", target, false, outside, "Directory");
  EXPECT_EQ(s.error_code(), grpc::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("--ephemeral_host_path_prefixes"), std::string::npos);
  // A symlink inside the allowed tree that leads out of it.
  fs::create_directory_symlink(outside, allowed + "/escape");
  fs::create_directories(allowed + "/dir");
  s = Publish("e", "", target, false, allowed + "/escape/../dir", "Directory");
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << "'..' is refused outright";
  fs::create_directory_symlink(outside, allowed + "/sub");
  fs::create_directories(outside + "/inner");
  s = Publish("e", "", target, false, allowed + "/sub/inner", "Directory");
  EXPECT_EQ(s.error_code(), grpc::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("resolves to " + outside + "/inner"), std::string::npos)
      << s.error_message();
  // ...OrCreate does not create through a symlinked component.
  s = Publish("e", "", target, false, allowed + "/sub/made-by-pod", "DirectoryOrCreate");
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION) << s.error_message();
  EXPECT_FALSE(fs::exists(outside + "/made-by-pod"));
  EXPECT_EQ(MountCountAt(target), 0);
  // Staged volumes (PersistentVolumes, made by an administrator) may use any host path.
  ASSERT_RPC_OK(Stage("pv", Staging("pv"), outside));
  ASSERT_RPC_OK(Unstage("pv", Staging("pv")));
  // With no prefixes configured, no unstaged hostPath volume is accepted.
  StopAgent();
  StartAgent({}, /*allow_ephemeral=*/false);
  fs::create_directories(allowed + "/ok");
  s = Publish("e", "", target, false, allowed + "/ok", "Directory");
  EXPECT_EQ(s.error_code(), grpc::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("(none set)"), std::string::npos);
}

TEST_F(VolumeE2ETest, AgentRestartKeepsEverythingIdempotent) {
  const std::string data = HostDir("d");
  const std::string staging = Staging("v"), target = Target("p", "v");
  ASSERT_RPC_OK(Stage("v", staging, data));
  ASSERT_RPC_OK(Publish("v", staging, target));
  agent_->Signal(SIGKILL);
  agent_->Wait(std::chrono::milliseconds(20000));
  agent_.reset();
  EXPECT_EQ(MountCountAt(target), 1) << "mounts outlive the agent";
  StartAgent();
  ASSERT_RPC_OK(Stage("v", staging, data));
  ASSERT_RPC_OK(Publish("v", staging, target));
  EXPECT_EQ(MountCountAt(staging), 1);
  EXPECT_EQ(MountCountAt(target), 1);
  NodeGetVolumeStatsResponse resp;
  ASSERT_RPC_OK(Stats("v", target, &resp));
  EXPECT_FALSE(resp.volume_condition().abnormal());
  ASSERT_RPC_OK(Unpublish("v", target));
  ASSERT_RPC_OK(Unstage("v", staging));
  EXPECT_EQ(MountCountAt(staging), 0);
  EXPECT_EQ(MountCountAt(target), 0);
}

// A path belongs to one volume: a staging path or target that is, contains or lies inside
// another volume's is refused, and a foreign mount of the same file system is never adopted.
TEST_F(VolumeE2ETest, OverlappingPathsOfAnotherVolumeAreRefused) {
  const std::string a_data = HostDir("a"), b_data = HostDir("b");  // one file system
  { std::ofstream(a_data + "/secret") << "volume a's data"; }
  const std::string a_staging = Staging("a"), a_target = Target("pa", "a");
  ASSERT_RPC_OK(Stage("a", a_staging, a_data));
  ASSERT_RPC_OK(Publish("a", a_staging, a_target));
  // B staged on A's target, or inside it, or around A's staging path.
  for (const std::string& bad : {a_target, a_target + "/sub", a_staging.substr(0, a_staging.rfind('/'))}) {
    grpc::Status s = Stage("b", bad, b_data);
    EXPECT_EQ(s.error_code(), grpc::ALREADY_EXISTS) << bad << ": " << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "volume a")) << s.error_message();
  }
  const std::string b_staging = Staging("b");
  ASSERT_RPC_OK(Stage("b", b_staging, b_data));
  // B published onto A's staging path or inside A's target.
  for (const std::string& bad : {a_staging, a_target + "/x"}) {
    grpc::Status s = Publish("b", b_staging, bad);
    EXPECT_EQ(s.error_code(), grpc::ALREADY_EXISTS) << bad << ": " << s.error_message();
  }
  // A new target where someone bound A's data (the same file system as B's): not adopted.
  const std::string planted = Target("pb", "b");
  fs::create_directories(planted);
  ASSERT_EQ(mount(a_data.c_str(), planted.c_str(), nullptr, MS_BIND, nullptr), 0);
  grpc::Status s = Publish("b", b_staging, planted);
  EXPECT_EQ(s.error_code(), grpc::ALREADY_EXISTS) << s.error_message();
  EXPECT_EQ(MountCountAt(planted), 1) << "the foreign mount is left alone, nothing stacked";
  ASSERT_EQ(umount2(planted.c_str(), MNT_DETACH), 0);
  // Nothing leaked: both volumes tear down cleanly.
  ASSERT_RPC_OK(Unpublish("a", a_target));
  ASSERT_RPC_OK(Unstage("a", a_staging));
  ASSERT_RPC_OK(Unstage("b", b_staging));
  EXPECT_EQ(MountCountAt(a_staging) + MountCountAt(b_staging) + MountCountAt(a_target), 0);
}

// kill -9 at each step between the mount syscalls and the state writes, restart, retry the RPC
// kubelet would retry, then tear down: never an orphan or duplicate mount.
class CrashPointTest : public VolumeE2ETest, public ::testing::WithParamInterface<const char*> {};

TEST_P(CrashPointTest, KillMinusNineThenRestartRecovers) {
  const std::string point = GetParam();
  const std::string data = HostDir("d");
  const std::string staging = Staging("v"), target = Target("p", "v");
  const bool crash_in_stage = point.rfind("stage-", 0) == 0;
  const bool crash_in_publish = point.rfind("publish-", 0) == 0;
  const bool crash_in_unpublish = point.rfind("unpublish-", 0) == 0;
  StopAgent();
  StartAgent({"FUSEKEEPER_CRASH_AT=" + point});

  grpc::Status s = Stage("v", staging, data);
  if (crash_in_stage) {
    EXPECT_FALSE(s.ok());
    ExpectAgentKilled();
    StartAgent();
    ASSERT_RPC_OK(Stage("v", staging, data));  // kubelet's retry
    if (point == std::string("stage-mounted")) {
      EXPECT_NE(agent_->Stderr().find("adopted staging mount"), std::string::npos) << agent_->Stderr();
    }
  } else {
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(MountCountAt(staging), 1);

  s = Publish("v", staging, target);
  if (crash_in_publish) {
    EXPECT_FALSE(s.ok());
    ExpectAgentKilled();
    StartAgent();
    ASSERT_RPC_OK(Publish("v", staging, target));
    if (point == std::string("publish-mounted")) {
      EXPECT_NE(agent_->Stderr().find("adopted mount at"), std::string::npos) << agent_->Stderr();
    }
  } else {
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(MountCountAt(target), 1);
  { std::ofstream(target + "/x") << "y"; }
  EXPECT_EQ(ReadFile(data + "/x"), "y");

  s = Unpublish("v", target);
  if (crash_in_unpublish) {
    EXPECT_FALSE(s.ok());
    ExpectAgentKilled();
    StartAgent();
    ASSERT_RPC_OK(Unpublish("v", target));
  } else {
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(MountCountAt(target), 0);
  EXPECT_FALSE(fs::exists(target));

  s = Unstage("v", staging);
  if (point == std::string("unstage-unmounted")) {
    EXPECT_FALSE(s.ok());
    ExpectAgentKilled();
    StartAgent();
    ASSERT_RPC_OK(Unstage("v", staging));
  } else {
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(MountCountAt(staging), 0);
  EXPECT_TRUE(fs::is_empty(state_ + "/volumes")) << "no state left behind";
}

// The same for a File-type host path: the target is a file the agent creates, and it must be
// gone after the unpublish whichever step the agent was killed at.
TEST_P(CrashPointTest, FileTargetKillMinusNineThenRestartRecovers) {
  const std::string point = GetParam();
  const std::string file = host_.path() + "/f.txt";
  { std::ofstream(file) << "file data"; }
  const std::string staging = Staging("vf"), target = Target("pf", "vf");
  StopAgent();
  StartAgent({"FUSEKEEPER_CRASH_AT=" + point});
  auto step = [&](const std::vector<std::string>& points, const std::function<grpc::Status()>& rpc) {
    grpc::Status s = rpc();
    if (std::find(points.begin(), points.end(), point) == points.end()) {
      ASSERT_TRUE(s.ok()) << s.error_message();
      return;
    }
    EXPECT_FALSE(s.ok());
    ExpectAgentKilled();
    StartAgent();
    s = rpc();
    ASSERT_TRUE(s.ok()) << "retry after " << point << ": " << s.error_message();
  };
  step({"stage-intent-saved", "stage-mounted"}, [&] { return Stage("vf", staging, file, "File"); });
  step({"publish-intent-saved", "publish-mounted"}, [&] { return Publish("vf", staging, target); });
  EXPECT_EQ(MountCountAt(target), 1);
  EXPECT_EQ(ReadFile(target), "file data");
  step({"unpublish-unmounted"}, [&] { return Unpublish("vf", target); });
  EXPECT_EQ(MountCountAt(target), 0);
  EXPECT_FALSE(fs::exists(target)) << "the file target the agent created is removed";
  step({"unstage-unmounted"}, [&] { return Unstage("vf", staging); });
  EXPECT_TRUE(fs::is_empty(state_ + "/volumes")) << "no state left behind";
}

INSTANTIATE_TEST_SUITE_P(Points, CrashPointTest,
                         ::testing::Values("stage-intent-saved", "stage-mounted",
                                           "publish-intent-saved", "publish-mounted",
                                           "unpublish-unmounted", "unstage-unmounted"));

TEST_F(VolumeE2ETest, ConcurrentRpcsOnManyVolumes) {
  constexpr int kVolumes = 24;
  std::vector<std::string> data, staging, target;
  for (int i = 0; i < kVolumes; ++i) {
    data.push_back(HostDir("c" + std::to_string(i)));
    staging.push_back(Staging("c" + std::to_string(i)));
    target.push_back(Target("pc" + std::to_string(i), "c" + std::to_string(i)));
  }
  auto run_all = [&](auto fn) {
    std::vector<std::future<grpc::Status>> fs;
    for (int i = 0; i < kVolumes; ++i) fs.push_back(std::async(std::launch::async, fn, i));
    int ok = 0;
    for (auto& f : fs) {
      grpc::Status s = f.get();
      EXPECT_TRUE(s.ok()) << s.error_message();
      ok += s.ok();
    }
    return ok;
  };
  EXPECT_EQ(run_all([&](int i) { return Stage("c" + std::to_string(i), staging[i], data[i]); }), kVolumes);
  EXPECT_EQ(run_all([&](int i) { return Publish("c" + std::to_string(i), staging[i], target[i]); }), kVolumes);
  for (int i = 0; i < kVolumes; ++i) EXPECT_EQ(MountCountAt(target[i]), 1);
  EXPECT_EQ(run_all([&](int i) { return Unpublish("c" + std::to_string(i), target[i]); }), kVolumes);
  EXPECT_EQ(run_all([&](int i) { return Unstage("c" + std::to_string(i), staging[i]); }), kVolumes);
  for (int i = 0; i < kVolumes; ++i) EXPECT_EQ(MountCountAt(staging[i]), 0);
}

TEST_F(VolumeE2ETest, SameVolumeConcurrentlyWaitsItsTurnNeverDoubled) {
  const std::string data = HostDir("d");
  const std::string staging = Staging("v");
  // Many identical stages at once: each waits its turn and succeeds (no ABORTED to back off from).
  std::vector<std::future<grpc::Status>> fs;
  for (int i = 0; i < 16; ++i) {
    fs.push_back(std::async(std::launch::async, [&] { return Stage("v", staging, data); }));
  }
  for (auto& f : fs) {
    grpc::Status s = f.get();
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(MountCountAt(staging), 1);
  // 50 pods publishing the shared volume at once, as kubelet does for a Deployment's replicas:
  // every one succeeds the first time, one mount each.
  std::vector<std::string> targets;
  for (int i = 0; i < 50; ++i) targets.push_back(Target("pod" + std::to_string(i), "v"));
  std::vector<std::future<grpc::Status>> pubs;
  for (const auto& t : targets) {
    pubs.push_back(std::async(std::launch::async, [&, t] { return Publish("v", staging, t); }));
  }
  for (auto& f : pubs) {
    grpc::Status s = f.get();
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  for (const auto& t : targets) EXPECT_EQ(MountCountAt(t), 1) << t;
  // They ran side by side (distinct targets of a staged volume), each recording only its own
  // target: after kill -9 and a restart, the saved state knows all 50.
  agent_->Signal(SIGKILL);
  agent_->Wait(std::chrono::milliseconds(20000));
  agent_.reset();
  StartAgent();
  for (const auto& t : targets) {
    NodeGetVolumeStatsResponse resp;
    ASSERT_RPC_OK(Stats("v", t, &resp));
    EXPECT_FALSE(resp.volume_condition().abnormal()) << t;
  }
  // Unpublished all at once too, and again nothing is lost: the volume can be unstaged (it would
  // be FAILED_PRECONDITION with a target left in its state), after another restart.
  std::vector<std::future<grpc::Status>> unpubs;
  for (const auto& t : targets) {
    unpubs.push_back(std::async(std::launch::async, [&, t] { return Unpublish("v", t); }));
  }
  for (auto& f : unpubs) {
    grpc::Status s = f.get();
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  for (const auto& t : targets) EXPECT_EQ(MountCountAt(t), 0) << t;
  StopAgent();
  StartAgent();
  ASSERT_RPC_OK(Unstage("v", staging));
  EXPECT_EQ(MountCountAt(staging), 0);
}

}  // namespace
}  // namespace fusekeeper
