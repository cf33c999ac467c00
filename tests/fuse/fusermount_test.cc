// fkserve's fusermount and the launcher's FusermountService, with the real (static) binary run as a FUSE
// library runs fusermount (argv[0] "fusermount3", _FUSE_COMMFD on fd 3): the connection arrives
// on the library's socket; options are judged and reported; bad input (no or a garbage
// _FUSE_COMMFD, junk on the launcher's socket, a second mount, unknown arguments) gets a clear
// error and leaves the connection and the service working.
#include "agent/fkserve/fusermount.h"

#include <fcntl.h>
#include <linux/kcmp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;

TEST(ClassifyMountOptionsTest, HarmlessAcceptedTheRestReportedWithWhy) {
  OptionVerdict v = ClassifyMountOptions({"rw,nosuid,nodev,fsname=bucket,subtype=s3fs,allow_other", "max_read=131072"},
                                         /*agent_read_only=*/false);
  EXPECT_EQ(v.accepted.size(), 7u);
  EXPECT_TRUE(v.not_applied.empty());
  v = ClassifyMountOptions({"ro,suid,dev,exec,context=system_u:object_r:fusefs_t:s0,frobnicate"}, false);
  ASSERT_EQ(v.not_applied.size(), 6u);
  EXPECT_TRUE(absl::StrContains(v.not_applied[0], "ro (the agent mounted the volume read-write)"));
  EXPECT_TRUE(absl::StrContains(v.not_applied[1], "never: the agent mounts nosuid,nodev"));
  EXPECT_TRUE(absl::StrContains(v.not_applied[5], "frobnicate (not known to fkserve)"));
  v = ClassifyMountOptions({"rw"}, /*agent_read_only=*/true);
  ASSERT_EQ(v.not_applied.size(), 1u);
  EXPECT_TRUE(absl::StrContains(v.not_applied[0], "read-only"));
  v = ClassifyMountOptions({"ro"}, true);
  EXPECT_EQ(v.accepted, std::vector<std::string>{"ro"});
}

// What gets copied into other people's images must run there: the fusermount is static, and the
// preload library needs nothing but libc (on a real node it was loaded into a user's bindfs image
// that had no libstdc++, and bindfs could not start).
TEST(CopiedIntoOtherImagesTest, FusermountIsStaticAndThePreloadLibraryNeedsOnlyLibc) {
  Subprocess preload({"/bin/sh", "-c", "/usr/bin/ldd " + RunfilePath("agent/fkserve/libfkserve_preload.so") + " >&2"});
  ASSERT_TRUE(preload.Wait(std::chrono::milliseconds(20000)).has_value());
  const std::string deps = preload.Stderr();
  for (const char* line : {"libstdc++", "libgcc_s", "libm.so", "libabsl", "libfuse"}) {
    EXPECT_FALSE(absl::StrContains(deps, line)) << line << " in\n" << deps;
  }
  EXPECT_TRUE(absl::StrContains(deps, "libc.so.6")) << deps;
  Subprocess is_static({"/bin/sh", "-c", "/usr/bin/ldd " + RunfilePath("agent/fkserve/fkserve-fusermount") + " >&2"});
  ASSERT_TRUE(is_static.Wait(std::chrono::milliseconds(20000)).has_value());
  EXPECT_TRUE(absl::StrContains(is_static.Stderr(), "not a dynamic executable")) << is_static.Stderr();
}

class FusermountTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fuse_ = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fuse_ < 0) GTEST_SKIP() << "cannot open /dev/fuse: " << strerror(errno);
    // fkserve-fusermount reached through a link named fusermount3, as a FUSE library finds it.
    fs::create_directories(dir_.path() + "/bin");
    fs::create_symlink(RunfilePath("agent/fkserve/fkserve-fusermount"), dir_.path() + "/bin/fusermount3");
    std::string error;
    // The service answers on a loop (the launcher's); this test's runs on a thread.
    loop_.RunOnLoop([&] {
      service_ = FusermountService::Start(loop_.loop(), dir_.path() + "/fusermount.sock", fuse_, false, &error);
    });
    ASSERT_NE(service_, nullptr) << error;
  }
  void TearDown() override {
    loop_.RunOnLoop([&] { service_.reset(); });
    if (fuse_ >= 0) close(fuse_);
  }
  bool Handed() {
    bool handed = false;
    loop_.RunOnLoop([&] { handed = service_->handed(); });
    return handed;
  }
  std::vector<std::string> Problems() {
    std::vector<std::string> problems;
    loop_.RunOnLoop([&] { problems = service_->problems(); });
    return problems;
  }
  struct Run {
    int status = -1;
    std::string stderr_text;
    int received_fd = -1;  // what arrived on the library's end of _FUSE_COMMFD
  };
  // Runs fusermount3 with `args`, its _FUSE_COMMFD on fd 3 (`commfd_env` overrides the value),
  // and `env`.
  Run Fusermount(std::vector<std::string> args, std::vector<std::string> env = {},
                 const std::string& commfd_env = "3") {
    int sv[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    args.insert(args.begin(), dir_.path() + "/bin/fusermount3");
    env.push_back("_FUSE_COMMFD=" + commfd_env);
    const int child_end = sv[1];
    Subprocess p(args, env, [child_end] { dup2(child_end, 3); });
    close(sv[1]);
    Run r;
    auto st = p.Wait(std::chrono::milliseconds(20000));
    EXPECT_TRUE(st.has_value()) << "fusermount hung";
    r.status = st && WIFEXITED(*st) ? WEXITSTATUS(*st) : -1;
    r.stderr_text = p.Stderr();
    char byte;
    iovec iov{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    if (recvmsg(sv[0], &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) == 1) {
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      if (c != nullptr && c->cmsg_type == SCM_RIGHTS) memcpy(&r.received_fd, CMSG_DATA(c), sizeof(int));
    }
    close(sv[0]);
    return r;
  }
  bool SameOpenFile(int a, int b) {
    return syscall(SYS_kcmp, getpid(), getpid(), KCMP_FILE, a, b) == 0;
  }

  ShortTempDir dir_;
  int fuse_ = -1;
  LoopThread loop_;
  std::unique_ptr<FusermountService> service_;
};

TEST_F(FusermountTest, HandsTheConnectionOverOnceAndReportsOptions) {
  const std::string mnt = dir_.path() + "/mnt";
  fs::create_directories(mnt);
  Run first = Fusermount({"-o", "rw,nosuid,nodev,fsname=demo,suid", "--", mnt});
  EXPECT_EQ(first.status, 0) << first.stderr_text;
  ASSERT_GE(first.received_fd, 0) << first.stderr_text;
  EXPECT_TRUE(SameOpenFile(first.received_fd, fuse_)) << "the very connection the launcher holds";
  close(first.received_fd);
  EXPECT_TRUE(absl::StrContains(first.stderr_text, "options NOT applied")) << first.stderr_text;
  EXPECT_TRUE(absl::StrContains(first.stderr_text, "suid (never")) << first.stderr_text;
  EXPECT_TRUE(Handed());
  // A second mount is refused, in the program's stderr and in the report for the agent.
  Run second = Fusermount({"-o", "rw", "--", mnt});
  EXPECT_EQ(second.status, 1);
  EXPECT_LT(second.received_fd, 0);
  EXPECT_TRUE(absl::StrContains(second.stderr_text, "a second mount")) << second.stderr_text;
  bool refused = false, options = false;
  for (const auto& p : Problems()) {
    refused = refused || absl::StrContains(p, "refused: a second mount");
    options = options || absl::StrContains(p, "options not applied: suid");
  }
  EXPECT_TRUE(refused && options);
  // Unmounting is a no-op that succeeds (the mount is the agent's).
  Run unmount = Fusermount({"-u", "-q", "-z", "--", mnt});
  EXPECT_EQ(unmount.status, 0) << unmount.stderr_text;
  // The connection is unharmed.
  EXPECT_EQ(fcntl(fuse_, F_GETFD), FD_CLOEXEC);
}

TEST_F(FusermountTest, BadInputGetsAClearErrorAndTheServiceKeepsWorking) {
  const std::string mnt = dir_.path() + "/mnt";
  fs::create_directories(mnt);
  // Not called by a FUSE library: no usable _FUSE_COMMFD.
  Run garbage = Fusermount({"--", mnt}, {}, "not-a-number");
  EXPECT_EQ(garbage.status, 1);
  EXPECT_TRUE(absl::StrContains(garbage.stderr_text, "_FUSE_COMMFD is not set to an open socket")) << garbage.stderr_text;
  Run closed = Fusermount({"--", mnt}, {}, "77");
  EXPECT_EQ(closed.status, 1);
  Run unknown = Fusermount({"--frobnicate", mnt});
  EXPECT_EQ(unknown.status, 1);
  EXPECT_TRUE(absl::StrContains(unknown.stderr_text, "unknown argument '--frobnicate'")) << unknown.stderr_text;
  Run nowhere = Fusermount({"-o", "rw"});
  EXPECT_EQ(nowhere.status, 1);
  EXPECT_TRUE(absl::StrContains(nowhere.stderr_text, "no mountpoint")) << nowhere.stderr_text;
  // Junk on the launcher's socket: answered with a refusal, no fd, and the service goes on.
  int junk = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  strcpy(addr.sun_path, (dir_.path() + "/fusermount.sock").c_str());
  ASSERT_EQ(connect(junk, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(send(junk, "\x01\x02garbage", 9, 0), 9);
  char buf[512];
  const ssize_t n = recv(junk, buf, sizeof(buf), 0);
  ASSERT_GT(n, 0);
  EXPECT_TRUE(absl::StrContains(std::string(buf, static_cast<size_t>(n)), "not fkserve's fusermount's"));
  close(junk);
  // None of that used up the handover.
  EXPECT_FALSE(Handed());
  Run good = Fusermount({"--", mnt});
  EXPECT_EQ(good.status, 0) << good.stderr_text;
  ASSERT_GE(good.received_fd, 0);
  EXPECT_TRUE(SameOpenFile(good.received_fd, fuse_));
  close(good.received_fd);
}

}  // namespace
}  // namespace fusekeeper
