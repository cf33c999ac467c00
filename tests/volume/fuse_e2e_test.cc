// FUSE volumes end to end: the real agent binary and the real reference server (fkserve, run
// unprivileged as uid 65534) in this test's private mount namespace, with a real /dev/fuse.
#include <sys/mount.h>
#include <sys/resource.h>

#include <algorithm>
#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "tests/volume/fuse_fixture.h"

namespace fusekeeper {
namespace {

using namespace csi::v1;
namespace fs = std::filesystem;

TEST_F(FuseE2ETest, InlineVolumePublishedBeforeItsSidecarThenServedUnprivileged) {
  StartAgent();
  const std::string target = Pod("pod-1", "vol");
  // NodePublish returns although no server exists yet (the sidecar starts after it).
  ASSERT_RPC_OK(PublishInline("inline-1", "pod-1", target));
  EXPECT_EQ(MountCountAt(target), 1);
  EXPECT_TRUE(Stats("inline-1", target).volume_condition().abnormal()) << "no server yet";
  struct stat st;
  ASSERT_EQ(lstat(PodSocket("pod-1").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, kServerUid) << "the socket belongs to the sidecar's user";
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // Reads wait for the server; it starts now and serves the export.
  Subprocess* server = StartServer(PodSocket("pod-1"));
  auto content = WithDeadline([&] { return ReadFile(target + "/hello.txt"); });
  ASSERT_TRUE(content.has_value()) << "read through the FUSE mount never completed\n" << server->Stderr();
  EXPECT_EQ(*content, "hello from the export\n");
  { std::ofstream(target + "/from-pod.txt") << "written through FUSE by the pod\n"; }
  EXPECT_EQ(ReadFile(export_ + "/from-pod.txt"), "written through FUSE by the pod\n");
  auto stats = Stats("inline-1", target);
  EXPECT_FALSE(stats.volume_condition().abnormal()) << stats.volume_condition().message();
  ASSERT_RPC_OK(Unpublish("inline-1", target));
  EXPECT_EQ(MountCountAt(target), 0);
  EXPECT_FALSE(fs::exists(target));
  EXPECT_FALSE(fs::exists(PodSocket("pod-1"))) << "the handoff socket is removed";
  EXPECT_TRUE(server->Wait(std::chrono::milliseconds(20000)).has_value()) << "the server did not end";
  EXPECT_TRUE(fs::exists(export_ + "/from-pod.txt")) << "no data lost";
}

// The kubelet makes a Memory emptyDir's directory, then mounts its tmpfs there; volumes are set
// up in parallel, so a NodePublish can make the handoff socket in between, under the tmpfs the
// sidecar then sees: the agent makes it again on top, where the sidecar looks.
TEST_F(FuseE2ETest, AHandoffSocketCoveredByTheEmptyDirsTmpfsIsMadeAgainWhereTheSidecarLooks) {
  StartAgent();
  const std::string target = Pod("pod-m", "vol");
  ASSERT_RPC_OK(PublishInline("inline-m", "pod-m", target));
  const std::string socket = PodSocket("pod-m");
  const std::string dir = socket.substr(0, socket.rfind('/'));
  ASSERT_EQ(mount("tmpfs", dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0777"), 0) << strerror(errno);
  struct Unmount {
    std::string dir;
    ~Unmount() { umount2(dir.c_str(), MNT_DETACH); }
  } unmount{dir};
  // The sidecar starts with the tmpfs in place, as the kubelet starts containers after volumes.
  Subprocess* server = StartServer(socket);
  auto content = WithDeadline([&] { return ReadFile(target + "/hello.txt"); });
  ASSERT_TRUE(content.has_value()) << "the sidecar was never served\n" << server->Stderr() << agent_->Stderr();
  EXPECT_EQ(*content, "hello from the export\n");
  struct stat st;
  ASSERT_EQ(lstat(socket.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_uid, kServerUid);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_RPC_OK(Unpublish("inline-m", target));
  EXPECT_FALSE(fs::exists(socket)) << "the socket made again is removed with the volume";
  EXPECT_TRUE(server->Wait(std::chrono::milliseconds(20000)).has_value()) << server->Stderr();
}

// A container runtime gives the agent's container a low soft fd limit (containerd 2.x: 1024) and
// a high hard one; each FUSE volume holds two fds (its connection and its handoff socket). Here
// the soft limit is 128 and the volumes need more: every stage succeeds, and after a kill -9 the
// restarted agent knows every one (none is forgotten, none is moved aside), and tears each down.
TEST_F(FuseE2ETest, ManyVolumesUnderTheRuntimesSoftFdLimitAndARestartForgetNone) {
  rlimit r{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &r), 0);
  if (r.rlim_max < 1024) GTEST_SKIP() << "the hard fd limit here is " << r.rlim_max << ", below what the test needs";
  agent_prefix_ = {"/usr/bin/prlimit", "--nofile=128:" + std::to_string(r.rlim_max)};
  StartAgent();
  constexpr int kVolumes = 100;
  std::vector<std::string> staging;  // made before: a path of a served-by-nobody mount cannot be stat'ed
  for (int i = 0; i < kVolumes; ++i) staging.push_back(StagingPath("many-" + std::to_string(i)));
  for (int i = 0; i < kVolumes; ++i) {
    const std::string id = "many-" + std::to_string(i);
    grpc::Status st = StageFuse(id, staging[i]);
    ASSERT_TRUE(st.ok()) << "volume " << i << ": " << st.error_message() << "\n" << agent_->Stderr();
  }
  agent_->Signal(SIGKILL);
  ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value());
  StartAgent();
  EXPECT_FALSE(absl::StrContains(agent_->Stderr(), "moved aside")) << agent_->Stderr();
  for (int i = 0; i < kVolumes; ++i) {
    const std::string id = "many-" + std::to_string(i);
    // Known: a repeated stage is idempotent (an unknown volume would find a mount in its way).
    grpc::Status st = StageFuse(id, staging[i]);
    ASSERT_TRUE(st.ok()) << "volume " << i << " after the restart: " << st.error_message() << "\n" << agent_->Stderr();
    ASSERT_RPC_OK(Unstage(id, staging[i]));
    EXPECT_EQ(MountCountAt(staging[i]), 0) << id;
  }
}

TEST_F(FuseE2ETest, StagedVolumeSharedByTwoPodsServedByANodeLevelServer) {
  StartAgent();
  const std::string staging = StagingPath("s1");
  {
    grpc::Status s = StageFuse("staged-1", staging);
    ASSERT_TRUE(s.ok()) << s.error_message() << agent_->Stderr();
  }
  const std::string socket = StagedSocket("staged-1");
  ASSERT_TRUE(fs::is_socket(socket));
  Subprocess* server = StartServer(socket);
  const std::string t1 = Pod("pod-a", "v"), t2 = Pod("pod-b", "v");
  for (const std::string& t : {t1, t2}) ASSERT_RPC_OK(PublishStaged("staged-1", staging, t));
  auto wrote = WithDeadline([&] {
    std::ofstream(t1 + "/shared.txt") << "written in pod a\n";
    return true;
  });
  ASSERT_TRUE(wrote.has_value()) << server->Stderr();
  EXPECT_EQ(ReadFile(t2 + "/shared.txt"), "written in pod a\n") << "read back through pod b";
  EXPECT_EQ(ReadFile(export_ + "/shared.txt"), "written in pod a\n");
  ASSERT_RPC_OK(Unpublish("staged-1", t1));
  ASSERT_RPC_OK(Unpublish("staged-1", t2));
  ASSERT_RPC_OK(Unstage("staged-1", staging));
  EXPECT_EQ(MountCountAt(staging), 0);
  EXPECT_FALSE(fs::exists(socket));
  EXPECT_TRUE(server->Wait(std::chrono::milliseconds(20000)).has_value());
}

// Kubelet passes a PV's mountOptions to NodePublishVolume exactly as it did to NodeStageVolume.
// Those went to the FUSE mount and its server at stage time; the pod's bind honours what a bind
// can (ro, noexec) and must not refuse the rest.
TEST_F(FuseE2ETest, AStagedVolumesServerMountOptionsDoNotBreakItsPublishes) {
  StartAgent();
  const std::string staging = StagingPath("opts-1");
  const std::vector<std::string> flags = {"noatime", "cache=strict", "ro"};
  ASSERT_RPC_OK(StageFuse("opts-1", staging, "", flags));
  Subprocess* server = StartServer(StagedSocket("opts-1"));
  const std::string a = Pod("pod-a", "opts-1");
  ASSERT_RPC_OK(PublishStaged("opts-1", staging, a, "a", "pod-a", "", flags));
  auto st = WithDeadline([&] {
    struct stat s{};
    return stat((a + "/hello.txt").c_str(), &s) == 0;
  });
  ASSERT_TRUE(st.has_value() && *st) << server->Stderr() << agent_->Stderr();
  EXPECT_LT(open((a + "/nope").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644), 0);
  EXPECT_EQ(errno, EROFS) << "ro among the PV's mount options makes the pod's view read-only";
  ASSERT_RPC_OK(PublishStaged("opts-1", staging, a, "a", "pod-a", "", flags));  // a repeat
  ASSERT_RPC_OK(Unpublish("opts-1", a));
  ASSERT_RPC_OK(Unstage("opts-1", staging));
}

TEST_F(FuseE2ETest, ReadOnlyAndFsGroup) {
  StartAgent();
  const std::string target = Pod("pod-ro", "vol");
  ASSERT_RPC_OK(PublishInline("ro-1", "pod-ro", target, /*readonly=*/true, /*fs_group=*/"4321"));
  StartServer(PodSocket("pod-ro"));
  auto st = WithDeadline([&] {
    struct stat s{};
    stat((target + "/hello.txt").c_str(), &s);
    return s;
  });
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->st_gid, 4321u) << "presented with the pod's fsGroup (VOLUME_MOUNT_GROUP)";
  EXPECT_LT(open((target + "/nope").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644), 0);
  EXPECT_EQ(errno, EROFS);
  EXPECT_EQ(PublishInline("bad-group", "pod-ro", Pod("pod-ro", "other"), false, "staff").error_code(),
            grpc::INVALID_ARGUMENT);
  ASSERT_RPC_OK(Unpublish("ro-1", target));
}

TEST_F(FuseE2ETest, AStagedVolumePublishedWithADifferentFsGroupIsRefusedNamingBothGroups) {
  StartAgent();
  const std::string staging = StagingPath("grp-1");
  ASSERT_RPC_OK(StageFuse("grp-1", staging, "2000"));
  Subprocess* server = StartServer(StagedSocket("grp-1"));
  const std::string a = Pod("pod-a", "grp-1"), b = Pod("pod-b", "grp-1"), c = Pod("pod-c", "grp-1");
  ASSERT_RPC_OK(PublishStaged("grp-1", staging, a, "a", "pod-a", "2000"));
  auto st = WithDeadline([&] {
    struct stat s{};
    stat((a + "/hello.txt").c_str(), &s);
    return s;
  });
  ASSERT_TRUE(st.has_value()) << server->Stderr() << agent_->Stderr();
  EXPECT_EQ(st->st_gid, 2000u);
  grpc::Status other = PublishStaged("grp-1", staging, b, "b", "pod-b", "3000");
  EXPECT_EQ(other.error_code(), grpc::FAILED_PRECONDITION) << other.error_message();
  EXPECT_TRUE(absl::StrContains(other.error_message(), "fsGroup 2000")) << other.error_message();
  EXPECT_TRUE(absl::StrContains(other.error_message(), "fsGroup 3000")) << other.error_message();
  EXPECT_EQ(MountCountAt(b), 0) << "nothing mounted for the refused pod";
  ASSERT_RPC_OK(PublishStaged("grp-1", staging, c, "c", "pod-c"));  // no fsGroup: nothing promised
  ASSERT_RPC_OK(Unpublish("grp-1", a));
  ASSERT_RPC_OK(Unpublish("grp-1", c));
  ASSERT_RPC_OK(Unstage("grp-1", staging));
  // Staged without any group, a pod asking for one is refused too.
  const std::string staging2 = StagingPath("grp-2");  // (made before the unserved mount is on it)
  const std::string d = Pod("pod-d", "grp-2");
  ASSERT_RPC_OK(StageFuse("grp-2", staging2));
  grpc::Status none = PublishStaged("grp-2", staging2, d, "d", "pod-d", "3000");
  EXPECT_EQ(none.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(none.error_message(), "no fsGroup")) << none.error_message();
  ASSERT_RPC_OK(Unstage("grp-2", staging2));
}

TEST_F(FuseE2ETest, AVolumeNoServerClaimsFailsFastAfterTheHandoffTimeoutStaysAMountAndHealsLater) {
  StartAgent({"--handoff_timeout_ms=300"});
  const std::string target = Pod("pod-lonely", "vol");
  ASSERT_RPC_OK(PublishInline("lonely", "pod-lonely", target));
  EXPECT_EQ(MountCountAt(target), 1);
  // A container created meanwhile (its runtime stats the mount: that waits) holds a copy.
  auto view = PodReader(target, "hello.txt");
  ASSERT_TRUE(agent_->WaitForStderr("FuseServerNeverConnected", 1, std::chrono::duration_cast<std::chrono::milliseconds>(kTestDeadline)))
      << agent_->Stderr();
  EXPECT_TRUE(absl::StrContains(agent_->Stderr(), "runs as uid 65534")) << agent_->Stderr();
  // Never a plain directory on the node's disk: still a mount, failing fast.
  EXPECT_EQ(MountCountAt(target), 1);
  auto attempt = WithDeadline([&] {
    int fd = open((target + "/written-to-node-disk").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    const int err = errno;
    if (fd >= 0) close(fd);
    return fd >= 0 ? 0 : err;
  });
  ASSERT_TRUE(attempt.has_value()) << "the unserved mount must fail fast, not hang";
  EXPECT_EQ(*attempt, ENOTCONN);
  EXPECT_TRUE(fs::exists(PodSocket("pod-lonely"))) << "a late server can still connect";
  NodeGetVolumeStatsResponse stats = Stats("lonely", target);
  EXPECT_TRUE(stats.volume_condition().abnormal());
  EXPECT_TRUE(absl::StrContains(stats.volume_condition().message(), PodSocket("pod-lonely")))
      << stats.volume_condition().message();
  // The server finally comes: it gets a fresh connection, which the container sees.
  StartServer(PodSocket("pod-lonely"));
  ASSERT_TRUE(view->WaitForReadsOf("hello from the export\n")) << agent_->Stderr();
  EXPECT_FALSE(Stats("lonely", target).volume_condition().abnormal());
  view->Stop();
  ASSERT_RPC_OK(Unpublish("lonely", target));
  EXPECT_EQ(MountCountAt(target), 0);
  EXPECT_FALSE(fs::exists(target));
}

TEST_F(FuseE2ETest, ServerKilledMidReadRpcsAnswerStatsAbnormalUnpublishCompletes) {
  StartAgent();
  const std::string target = Pod("pod-k", "vol");
  ASSERT_RPC_OK(PublishInline("killed", "pod-k", target));
  Subprocess* server = StartServer(PodSocket("pod-k"));
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(target + "/hello.txt"); }).has_value());
  server->Signal(SIGKILL);
  ASSERT_TRUE(server->Wait(std::chrono::milliseconds(20000)).has_value());
  // The agent learns of the death from the handoff connection closing: stats say so at once.
  auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
  while (Stats("killed", target).volume_condition().message().find("closed its connection") == std::string::npos) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the server's death was not noticed";
  }
  // A reader now waits on the dead server (the agent keeps the connection open for recovery).
  auto stuck = std::async(std::launch::async, [&] {
    struct stat st;
    return stat((target + "/another").c_str(), &st) == 0 ? 0 : errno;
  });
  // RPCs keep answering.
  NodeGetInfoResponse info;
  auto c = Ctx();
  ASSERT_RPC_OK(node_->NodeGetInfo(c.get(), {}, &info));
  auto stats = WithDeadline([&] { return Stats("killed", target); }, std::chrono::seconds(5));
  ASSERT_TRUE(stats.has_value()) << "NodeGetVolumeStats did not answer within its deadline";
  EXPECT_TRUE(stats->volume_condition().abnormal());
  // Unpublish completes (abort + unmount), and the stuck reader is released.
  auto unpublished = WithDeadline([&] { return Unpublish("killed", target); });
  ASSERT_TRUE(unpublished.has_value()) << "NodeUnpublish hung on a dead FUSE server";
  EXPECT_TRUE(unpublished->ok()) << unpublished->error_message();
  ASSERT_EQ(stuck.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_NE(stuck.get(), 0);
  EXPECT_EQ(MountCountAt(target), 0);
}

// Servers that take the fd and then never answer: statfs on their mounts hangs forever. More of
// them than the agent has probe threads must not make a healthy volume look unresponsive.
TEST_F(FuseE2ETest, HealthyVolumesStayHealthyBesideManyHungOnes) {
  StartAgent();
  std::vector<std::pair<UniqueFd, UniqueFd>> hung;  // socket, fuse fd: held, never served
  for (int i = 0; i < 6; ++i) {
    const std::string pod = "hung-" + std::to_string(i);
    const std::string target = Pod(pod, "vol");
    ASSERT_RPC_OK(PublishInline("hung-vol-" + std::to_string(i), pod, target));
    UniqueFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    strncpy(a.sun_path, PodSocket(pod).c_str(), sizeof(a.sun_path) - 1);
    ASSERT_EQ(connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    auto m = ReceiveHandoffMessage(s.get());
    ASSERT_TRUE(m.ok() && m->fd.valid());
    ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply({.ok = true}), -1).ok());
    hung.emplace_back(std::move(s), std::move(m->fd));
    auto st = Stats("hung-vol-" + std::to_string(i), target);  // pins a probe thread for good
    EXPECT_TRUE(st.volume_condition().abnormal());
  }
  // A healthy host-path volume next to them.
  const std::string data = root_.path() + "/healthy";
  const std::string staging = kubelet_ + "/plugins/healthy/globalmount";
  fs::create_directories(data);
  fs::create_directories(staging);
  NodeStageVolumeRequest r;
  r.set_volume_id("healthy");
  r.set_staging_target_path(staging);
  *r.mutable_volume_capability() = MountCapability();
  (*r.mutable_volume_context())["kind"] = "hostPath";
  (*r.mutable_volume_context())["path"] = data;
  NodeStageVolumeResponse resp;
  auto c = Ctx();
  ASSERT_RPC_OK(node_->NodeStageVolume(c.get(), r, &resp));
  for (int i = 0; i < 3; ++i) {
    auto st = Stats("healthy", staging);
    EXPECT_FALSE(st.volume_condition().abnormal()) << st.volume_condition().message();
  }
  for (int i = 0; i < 6; ++i) {
    const std::string pod = "hung-" + std::to_string(i);
    ASSERT_RPC_OK(Unpublish("hung-vol-" + std::to_string(i),
                            kubelet_ + "/pods/" + pod + "/volumes/kubernetes.io~csi/vol/mount"));
  }
}

TEST_F(FuseE2ETest, MountFlagsKernelOnesHonouredOthersToTheServerInjectionRefused) {
  StartAgent();
  const std::string target = Pod("pod-flags", "vol");
  ASSERT_RPC_OK(PublishInline("flags", "pod-flags", target, false, "",
                              {"noexec", "max_read=65536", "cache=yes", "ro"}));
  const MountEntry* e = nullptr;
  auto table = ReadMountTable();
  e = table.FindTop(target);
  ASSERT_NE(e, nullptr);
  EXPECT_TRUE(absl::StrContains(e->mount_options, "noexec")) << e->mount_options;
  EXPECT_TRUE(e->read_only());
  EXPECT_TRUE(absl::StrContains(e->super_options, "max_read=65536")) << e->super_options;
  // The server's config carries what the kernel did not take.
  UniqueFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  strncpy(a.sun_path, PodSocket("pod-flags").c_str(), sizeof(a.sun_path) - 1);
  ASSERT_EQ(connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  auto m = ReceiveHandoffMessage(s.get());
  ASSERT_TRUE(m.ok());
  auto config = DecodeMountConfig(m->payload);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->mount_options, std::vector<std::string>{"cache=yes"});
  EXPECT_TRUE(config->read_only);
  // Options the agent controls, or smuggled through a comma, are refused; nothing is mounted.
  for (std::vector<std::string> bad : {std::vector<std::string>{"fd=3"}, {"rootmode=100000"},
                                       {"user_id=0"}, {"allow_other"}, {"rw,fd=3"}, {"max_read=x"}}) {
    const std::string t = Pod("pod-bad", "v" + std::to_string(MountCountAt(target)));
    grpc::Status st = PublishInline("bad-flags", "pod-bad", t, false, "", bad);
    EXPECT_EQ(st.error_code(), grpc::INVALID_ARGUMENT) << bad[0] << ": " << st.error_message();
    EXPECT_EQ(st.error_message().find("=3"), std::string::npos) << "flag values are not echoed";
    EXPECT_EQ(MountCountAt(t), 0);
  }
  ASSERT_RPC_OK(Unpublish("flags", target));
}

// The pod's socket directory (its emptyDir) must be a real directory owned by root or the
// server's uid: a symlink, or someone else's directory, is refused and nothing is created.
TEST_F(FuseE2ETest, SocketDirectoriesThatAreSymlinksOrForeignAreRefused) {
  StartAgent();
  const std::string outside = root_.path() + "/elsewhere";
  fs::create_directories(outside);
  const std::string target = Pod("pod-sym", "vol");
  const std::string fk = kubelet_ + "/pods/pod-sym/volumes/kubernetes.io~empty-dir/fk";
  fs::remove_all(fk);
  fs::create_directory_symlink(outside, fk);
  grpc::Status s = PublishInline("sym", "pod-sym", target);
  EXPECT_NE(s.error_code(), grpc::OK);
  EXPECT_TRUE(s.error_code() == grpc::INVALID_ARGUMENT || s.error_code() == grpc::FAILED_PRECONDITION)
      << s.error_message();
  EXPECT_TRUE(fs::is_empty(outside)) << "no socket created through the symlink";
  EXPECT_EQ(MountCountAt(target), 0);

  const std::string target2 = Pod("pod-foreign", "vol");
  const std::string fk2 = kubelet_ + "/pods/pod-foreign/volumes/kubernetes.io~empty-dir/fk";
  ASSERT_EQ(chown(fk2.c_str(), 4242, 4242), 0);  // neither root nor the server's uid
  s = PublishInline("foreign", "pod-foreign", target2);
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("belongs to uid 4242"), std::string::npos) << s.error_message();
  EXPECT_FALSE(fs::exists(fk2 + "/fusekeeper.sock"));
  EXPECT_EQ(MountCountAt(target2), 0);
}

TEST_F(FuseE2ETest, GarbageOnTheHandoffSocketDoesNotDisturbTheVolume) {
  StartAgent();
  const std::string target = Pod("pod-g", "vol");
  ASSERT_RPC_OK(PublishInline("garbage", "pod-g", target));
  {
    UniqueFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    strncpy(a.sun_path, PodSocket("pod-g").c_str(), sizeof(a.sun_path) - 1);
    ASSERT_EQ(connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    auto m = ReceiveHandoffMessage(s.get());  // we are root: allowed, but we answer nonsense
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE(SendHandoffMessage(s.get(), "\x01\x02 not json", -1).ok());
  }
  StartServer(PodSocket("pod-g"));
  auto content = WithDeadline([&] { return ReadFile(target + "/hello.txt"); });
  ASSERT_TRUE(content.has_value());
  EXPECT_EQ(*content, "hello from the export\n");
  ASSERT_RPC_OK(Unpublish("garbage", target));
}

// In a cluster the agent and the server are in different pid namespaces: SO_PEERCRED says pid 0.
// The logs name the server by uid then, and nothing relies on the pid.
TEST_F(FuseE2ETest, AServerInAnotherPidNamespaceIsNamedByItsUid) {
  agent_prefix_ = {"/usr/bin/unshare", "--pid", "--fork", "--kill-child=SIGTERM"};
  StartAgent();
  const std::string target = Pod("pod-ns", "ns-1");
  ASSERT_RPC_OK(PublishInline("ns-1", "pod-ns", target));
  StartServer(PodSocket("pod-ns"));
  auto got = WithDeadline([&] { return ReadFile(target + "/hello.txt"); });
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, "hello from the export\n");
  EXPECT_NE(agent_->Stderr().find("handed to server uid 65534 (pid not visible: another pid namespace)"),
            std::string::npos)
      << agent_->Stderr();
  EXPECT_EQ(agent_->Stderr().find("server pid 0"), std::string::npos);
  ASSERT_RPC_OK(Unpublish("ns-1", target));
}

// Kubelet publishes one staged FUSE volume into many pods at once and retries each publish
// (ABORTED included): every target ends with exactly one mount that reads through the server,
// repeats of the same target never stack a second one, and everything unpublishes cleanly.
TEST_F(FuseE2ETest, ConcurrentPublishesOfOneStagedVolumeNeverStackAMount) {
  StartAgent();
  const std::string staging = StagingPath("many");
  ASSERT_RPC_OK(StageFuse("many", staging));
  StartServer(StagedSocket("many"));
  constexpr int kPods = 16;
  std::vector<std::string> targets;
  for (int i = 0; i < kPods; ++i) targets.push_back(Pod("pod-" + std::to_string(i), "many"));
  auto publish_until_ok = [&](int i) {
    grpc::Status s;
    for (auto deadline = std::chrono::steady_clock::now() + kTestDeadline; std::chrono::steady_clock::now() < deadline;) {
      s = PublishStaged("many", staging, targets[static_cast<size_t>(i)], "p" + std::to_string(i), "pod-" + std::to_string(i));
      if (s.error_code() != grpc::ABORTED) break;
    }
    return s;
  };
  std::vector<std::future<grpc::Status>> calls;
  for (int round = 0; round < 2; ++round) {  // each target published twice, concurrently
    for (int i = 0; i < kPods; ++i) calls.push_back(std::async(std::launch::async, publish_until_ok, i));
  }
  for (auto& c : calls) {
    grpc::Status s = c.get();
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  for (const auto& t : targets) {
    EXPECT_EQ(MountCountAt(t), 1) << t;
    auto got = WithDeadline([&] { return ReadFile(t + "/hello.txt"); });
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(*got, "hello from the export\n");
  }
  for (const auto& t : targets) ASSERT_RPC_OK(Unpublish("many", t));
  ASSERT_RPC_OK(Unstage("many", staging));
  for (const auto& t : targets) EXPECT_EQ(MountCountAt(t), 0);
  EXPECT_EQ(MountCountAt(staging), 0);
  EXPECT_TRUE(fs::is_empty(state_ + "/volumes"));
}

// The sidecar's startupProbe: `fkserve ready` says 0 only while the volume is served.
TEST_F(FuseE2ETest, TheReadyFileTracksServingForAStartupProbe) {
  StartAgent();
  const std::string target = Pod("pod-r", "ready-1");
  // In the pod's emptyDir, as the example sidecar has it (writable by the server's uid).
  const std::string ready = PodSocket("pod-r").substr(0, PodSocket("pod-r").rfind('/')) + "/fkserve.ready";
  std::string said;  // the probe's output, which kubelet's Unhealthy Event quotes
  auto probe = [&] {
    Subprocess p({fkserve_, "--ready_file=" + ready, "ready"});
    auto status = p.Wait(std::chrono::milliseconds(20000));
    said = p.Stderr();
    return status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
  };
  EXPECT_EQ(probe(), 1) << "nothing served yet";
  // A sidecar that starts before the volume is published waits for its socket, and the probe
  // says so in the sidecar's words.
  Subprocess* server = StartServer(PodSocket("pod-r"), {"--ready_file=" + ready, "serve", "--root=" + export_});
  ASSERT_TRUE(server->WaitForStderr("waiting up to", 1, kTestDeadline)) << server->Stderr();
  EXPECT_EQ(probe(), 1);
  EXPECT_TRUE(absl::StrContains(said, "not serving yet: cannot connect to " + PodSocket("pod-r"))) << said;
  ASSERT_RPC_OK(PublishInline("ready-1", "pod-r", target));
  ASSERT_TRUE(WithDeadline([&] { return ReadFile(target + "/hello.txt"); }).has_value());
  EXPECT_EQ(probe(), 0) << server->Stderr();
  ASSERT_RPC_OK(Unpublish("ready-1", target));
  ASSERT_TRUE(server->Wait(std::chrono::milliseconds(20000)).has_value());
  EXPECT_EQ(probe(), 1) << "serving ended";
}

// kill -9 at each step of a FUSE volume's life between a mount syscall and the state write,
// restart, retry what kubelet would retry, serve, read, tear down: never a leaked mount, socket
// or state file, and never a volume that kubelet's retries cannot bring back.
class FuseCrashPointTest : public FuseE2ETest, public ::testing::WithParamInterface<const char*> {
 protected:
  void ExpectAgentKilled() {
    auto status = agent_->Wait(std::chrono::milliseconds(20000));
    ASSERT_TRUE(status.has_value());
    EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL) << agent_->Stderr();
  }
  // Runs `rpc`; if the crash point is one of `points` (the ones `rpc` passes), expects the agent
  // to die there, restarts it and retries `rpc` (kubelet's retry).
  void Step(const std::vector<std::string>& points, const std::function<grpc::Status()>& rpc) {
    grpc::Status s = rpc();
    const std::string point = GetParam();
    if (std::find(points.begin(), points.end(), point) == points.end()) {
      ASSERT_TRUE(s.ok()) << points[0] << ": " << s.error_message() << agent_->Stderr();
      return;
    }
    EXPECT_FALSE(s.ok());
    ExpectAgentKilled();
    agent_env_.clear();
    StartAgent({"--redeposit_wait_ms=100"});
    s = rpc();
    ASSERT_TRUE(s.ok()) << "retry after " << point << ": " << s.error_message() << agent_->Stderr();
  }
};

// Every temporary name a killed agent may leave in `dir` (a handoff socket's before its rename,
// a state file's before its rename).
std::vector<std::string> TempNamesIn(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename();
    if (absl::StrContains(name, ".tmp")) out.push_back(name);
  }
  return out;
}

class FuseStagedCrashPointTest : public FuseCrashPointTest {};
class FuseInlineCrashPointTest : public FuseCrashPointTest {};

TEST_P(FuseStagedCrashPointTest, StagedVolumeKillMinusNineThenRestartRecovers) {
  const std::string point = GetParam();
  agent_env_ = {"FUSEKEEPER_CRASH_AT=" + point};
  StartAgent();
  const std::string staging = StagingPath("crash-s");
  const std::string target = Pod("pod-c", "crash-s");
  Step({"state-unnamed", "fuse-stage-mounted", "handoff-socket-unnamed"},
       [&] { return StageFuse("crash-s", staging); });
  EXPECT_EQ(MountCountAt(staging), 1);
  Step({"publish-intent-saved", "publish-mounted"},
       [&] { return PublishStaged("crash-s", staging, target, "c", "pod-c"); });
  EXPECT_EQ(MountCountAt(target), 1);
  // The node-level server starts (any connection the killed agent held died with it: the server
  // gets a fresh one, stacked where the pod sees it).
  Subprocess* server = StartServer(StagedSocket("crash-s"));
  auto view = PodReader(target, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf("hello from the export\n")) << view->setup_error() << server->Stderr()
                                                               << agent_->Stderr();
  view->Stop();
  // Served: the restarted agent has reconciled and made the socket again, and what the killed
  // one left under a temporary name is gone.
  EXPECT_TRUE(TempNamesIn(state_ + "/sockets").empty()) << absl::StrJoin(TempNamesIn(state_ + "/sockets"), ", ");
  EXPECT_TRUE(TempNamesIn(state_ + "/volumes").empty()) << absl::StrJoin(TempNamesIn(state_ + "/volumes"), ", ");
  Step({"unpublish-unmounted"}, [&] { return Unpublish("crash-s", target); });
  EXPECT_EQ(MountCountAt(target), 0);
  EXPECT_FALSE(fs::exists(target));
  ASSERT_RPC_OK(Unstage("crash-s", staging));
  EXPECT_EQ(MountCountAt(staging), 0);
  EXPECT_FALSE(fs::exists(StagedSocket("crash-s")));
  EXPECT_TRUE(TempNamesIn(state_ + "/sockets").empty()) << absl::StrJoin(TempNamesIn(state_ + "/sockets"), ", ");
  EXPECT_TRUE(fs::is_empty(state_ + "/volumes")) << "no state left behind";
}

TEST_P(FuseInlineCrashPointTest, InlineVolumeKillMinusNineThenRestartRecovers) {
  const std::string point = GetParam();
  agent_env_ = {"FUSEKEEPER_CRASH_AT=" + point};
  StartAgent();
  const std::string target = Pod("pod-i", "crash-i");
  Step({"state-unnamed", "fuse-publish-mounted", "handoff-socket-unnamed"},
       [&] { return PublishInline("crash-i", "pod-i", target); });
  EXPECT_EQ(MountCountAt(target), 1);
  StartServer(PodSocket("pod-i"));
  auto view = PodReader(target, "hello.txt");
  ASSERT_TRUE(view->WaitForReadsOf("hello from the export\n")) << view->setup_error() << agent_->Stderr();
  view->Stop();
  const std::string socket_dir = PodSocket("pod-i").substr(0, PodSocket("pod-i").rfind('/'));
  EXPECT_TRUE(TempNamesIn(socket_dir).empty()) << absl::StrJoin(TempNamesIn(socket_dir), ", ");
  EXPECT_TRUE(TempNamesIn(state_ + "/volumes").empty()) << absl::StrJoin(TempNamesIn(state_ + "/volumes"), ", ");
  Step({"unpublish-unmounted"}, [&] { return Unpublish("crash-i", target); });
  EXPECT_EQ(MountCountAt(target), 0);
  EXPECT_FALSE(fs::exists(target));
  EXPECT_FALSE(fs::exists(PodSocket("pod-i")));
  EXPECT_TRUE(TempNamesIn(socket_dir).empty()) << absl::StrJoin(TempNamesIn(socket_dir), ", ");
  EXPECT_TRUE(fs::is_empty(state_ + "/volumes")) << "no state left behind";
}

INSTANTIATE_TEST_SUITE_P(Points, FuseStagedCrashPointTest,
                         ::testing::Values("state-unnamed", "fuse-stage-mounted", "handoff-socket-unnamed",
                                           "publish-intent-saved", "publish-mounted", "unpublish-unmounted"));
INSTANTIATE_TEST_SUITE_P(Points, FuseInlineCrashPointTest,
                         ::testing::Values("state-unnamed", "fuse-publish-mounted", "handoff-socket-unnamed",
                                           "unpublish-unmounted"));

// Issue 30 part 3: a node registered with the readiness taint keeps workloads off until the
// agent serves; the agent removes that taint (and only it, guarded by the node's resourceVersion)
// once the kubelet lists its driver on the CSINode, and never puts it back: a restarted agent
// leaves an untainted node alone.
TEST_F(FuseE2ETest, TheReadinessTaintIsRemovedOnceTheDriverIsRegisteredAndOnlyIt) {
  FakeKube& kube = StartKube();
  const std::string csinode = "/apis/storage.k8s.io/v1/csinodes/n", node = "/api/v1/nodes/n";
  const std::string tainted = R"({"kind":"Node","metadata":{"name":"n","resourceVersion":"41"},"spec":{"taints":[)"
                              R"({"key":"fusekeeper.csi/agent-not-ready","effect":"NoExecute"},)"
                              R"({"key":"dedicated","value":"fuse","effect":"NoSchedule"}]}})";
  kube.SetObjects({{csinode, R"({"kind":"CSINode","spec":{"drivers":[{"name":"other.csi"}]}})"}, {node, tainted}});
  const std::string taint_flag = "--readiness_taint=fusekeeper.csi/agent-not-ready";
  StartAgent({"--kube_secrets_dir=" + secrets_, taint_flag});
  // Not registered yet: asked again, the node left alone.
  ASSERT_TRUE(kube.WaitForAnswered("GET:" + csinode, 2)) << agent_->Stderr();
  auto patches = [&] {
    int n = 0;
    for (const auto& line : kube.Log()) n += absl::StrContains(line, "\"verb\": \"PATCH\", \"path\": \"" + node + "\"");
    return n;
  };
  EXPECT_EQ(patches(), 0);
  kube.SetObjects({{csinode, R"({"kind":"CSINode","spec":{"drivers":[{"name":"other.csi"},{"name":"fusekeeper.csi"}]}})"},
                   {node, tainted}});
  ASSERT_TRUE(kube.WaitForAnswered("PATCH:" + node)) << agent_->Stderr() << kube.Diagnostics();
  ASSERT_TRUE(agent_->WaitForStderr("taint fusekeeper.csi/agent-not-ready removed", 1, std::chrono::seconds(20)));
  std::string body;
  for (const auto& line : kube.Log()) {
    if (absl::StrContains(line, "\"verb\": \"PATCH\"")) body = line;
  }
  // The patch, as the double logged it (JSON inside JSON): the guard, then the other taint kept.
  EXPECT_TRUE(absl::StrContains(body, R"({\"op\":\"test\",\"path\":\"/metadata/resourceVersion\",\"value\":\"41\"})"))
      << body;
  EXPECT_TRUE(absl::StrContains(body, R"(\"value\":[{\"effect\":\"NoSchedule\",\"key\":\"dedicated\",\"value\":\"fuse\"}])"))
      << body;
  EXPECT_FALSE(absl::StrContains(body, "agent-not-ready")) << body;
  EXPECT_EQ(patches(), 1);
  // A restart (volumes to adopt or not) finds the node untainted and leaves it so.
  kube.SetObjects({{csinode, R"({"kind":"CSINode","spec":{"drivers":[{"name":"fusekeeper.csi"}]}})"},
                   {node, R"({"kind":"Node","metadata":{"name":"n","resourceVersion":"42"},"spec":{"taints":[)"
                          R"({"key":"dedicated","value":"fuse","effect":"NoSchedule"}]}})"}});
  agent_->Signal(SIGTERM);
  ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value());
  StartAgent({"--kube_secrets_dir=" + secrets_, taint_flag});
  ASSERT_TRUE(agent_->WaitForStderr("does not carry taint fusekeeper.csi/agent-not-ready", 1, std::chrono::seconds(20)))
      << agent_->Stderr();
  EXPECT_EQ(patches(), 1);
}

}  // namespace
}  // namespace fusekeeper
