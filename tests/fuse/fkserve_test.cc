// The reference server end to end: the agent's side (a real FUSE mount and a HandoffEndpoint on
// the ring) in this process, fkserve as a child process, in a private mount namespace.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <filesystem>
#include <algorithm>
#include <fstream>
#include <functional>
#include <future>
#include <set>

#include "agent/fuse/fuse_mount.h"
#include "agent/fuse/handoff_endpoint.h"
#include "gtest/gtest.h"
#include "tests/testing/hello_fuse_server.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/with_deadline.h"
#include "tests/testing/mount_fixture.h"
#include "tests/testing/no_io_uring.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// Each thread's state letter (R, S, T...) in /proc/<pid>/task/<tid>/stat, in one string.
std::string ThreadStates(pid_t pid) {
  std::string out;
  DIR* d = opendir(("/proc/" + std::to_string(pid) + "/task").c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream st("/proc/" + std::to_string(pid) + "/task/" + e->d_name + "/stat");
    std::string line;
    std::getline(st, line);
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size()) out.push_back(line[paren + 2]);
  }
  closedir(d);
  return out;
}

class FkserveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access("/dev/fuse", R_OK | W_OK) != 0) GTEST_SKIP() << "no /dev/fuse";
    export_ = root_.path() + "/export";
    mnt_ = root_.path() + "/mnt";
    sockdir_ = root_.path() + "/sock";
    for (const auto& d : {export_, mnt_, sockdir_}) fs::create_directories(d);
    chmod(root_.path().c_str(), 0755);
    { std::ofstream(export_ + "/existing.txt") << "already here\n"; }
  }
  void TearDown() override {
    Unmount(MNT_DETACH);
    if (endpoint_) lt_.RunOnLoop([&] { endpoint_->Stop(); });
    endpoint_.reset();
    if (server_) server_->Wait(std::chrono::milliseconds(20000));
    lt_.StopAndJoin();
  }

  // As the agent ends a volume: its socket first (a server whose connection then ends finds it
  // gone and is done: handoff_client.h ReceiveNextHandoffBlocking), then the unmount.
  int Unmount(int flags) {
    unlink((sockdir_ + "/s").c_str());
    return umount2(mnt_.c_str(), flags);
  }
  // Mounts a connection on mnt_ and offers it on sockdir_/s to `server_uid`.
  void MountAndOffer(MountConfig config, bool read_only = false, uid_t server_uid = 0) {
    auto dev = OpenFuseDeviceBlocking();
    ASSERT_TRUE(dev.ok()) << dev.status();
    UniqueFd target(open(mnt_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    ASSERT_TRUE(MountFuseBlocking(dev->get(), target.get(), mnt_, {.source = config.volume_id,
                                                                    .read_only = read_only}).ok());
    UniqueFd dir(open(sockdir_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    auto listen = HandoffEndpoint::ListenBlocking(dir.get(), "s", server_uid, server_uid);
    ASSERT_TRUE(listen.ok()) << listen.status();
    if (server_uid != 0) chmod(sockdir_.c_str(), 0755);
    lt_.RunOnLoop([&] {
      HandoffEndpoint::Events events;
      events.on_served = [this](const HandoffReply&, pid_t) { served_.set_value(); };
      events.on_connection_error = [this](const absl::Status& s) { last_error_ = s; };
      events.on_server_gone = [this](const absl::Status& s) { gone_.set_value(s); };
      events.on_server_notice = [this](const HandoffReply& reply) {
        const std::string& n = reply.notice;
        if (!noticed_) notice_.set_value(n);
        noticed_ = true;
      };
      endpoint_ = HandoffEndpoint::Start(lt_.loop(), std::move(*listen), std::move(*dev), config, {},
                                         std::move(events));
    });
  }
  void StartServer(std::vector<std::string> args, uid_t uid = 0, std::vector<std::string> prefix = {}) {
    std::string binary = RunfilePath("agent/fkserve/fkserve");
    if (uid != 0) {
      // Bazel's runfiles live under /root (0700): give the unprivileged server a copy it can run.
      const std::string copy = root_.path() + "/fkserve";
      fs::copy_file(binary, copy, fs::copy_options::overwrite_existing);
      // Its preload library goes beside it (the launcher looks for it there).
      for (const char* beside : {"libfkserve_preload.so", "fkserve-fusermount"}) {
        fs::copy_file(RunfilePath(std::string("agent/fkserve/") + beside), root_.path() + "/" + beside,
                      fs::copy_options::overwrite_existing);
      }
      fs::permissions(copy, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec |
                                fs::perms::group_read | fs::perms::others_read);
      binary = copy;
    }
    std::vector<std::string> cmd = prefix;
    cmd.push_back(binary);
    cmd.push_back("--socket=" + sockdir_ + "/s");
    cmd.insert(cmd.end(), args.begin(), args.end());
    std::function<void()> drop;
    const bool no_ring = refuse_io_uring_;
    if (uid != 0 || no_ring) {
      drop = [uid, no_ring] {
        if (uid != 0 && (setresgid(uid, uid, uid) != 0 || setresuid(uid, uid, uid) != 0)) _exit(99);
        if (no_ring && !RefuseIoUring()) _exit(98);
      };
    }
    server_ = std::make_unique<Subprocess>(cmd, std::vector<std::string>{}, drop);
  }
  bool WaitServed() {
    return served_.get_future().wait_for(kTestDeadline) == std::future_status::ready;
  }
  // How a test serves: fkserve serve, or hello_fuse launched in each relaying way.
  enum Mode { kServe, kInProgram, kHop, kDirect };
  static const char* ModeName(Mode m) {
    return m == kServe ? "serve" : m == kInProgram ? "in-program" : m == kHop ? "hop" : "direct";
  }
  // Mounts a fresh connection for volume `prefix`-<mode> and starts fkserve on it: serve of
  // export_, or `fkserve launch` of hello_fuse with `content` on /dev/fd/{fd}.
  void StartMode(Mode mode, const std::string& prefix, const std::string& content) {
    served_ = std::promise<void>();
    gone_ = std::promise<absl::Status>();
    MountAndOffer({.volume_id = prefix + ModeName(mode)});
    std::vector<std::string> args = {"launch", "--", RunfilePath("tests/testing/hello_fuse"), "/dev/fd/{fd}", content};
    if (mode == kDirect) args.insert(args.begin(), "--direct");
    if (mode == kHop) args.insert(args.begin(), "--in_program=false");
    if (mode == kServe) args = {"serve", "--root=" + export_};
    StartServer(args);
  }
  // The launcher's program: its first child.
  pid_t LaunchedProgram() {
    const std::string pid = std::to_string(server_->pid());
    std::ifstream children("/proc/" + pid + "/task/" + pid + "/children");
    pid_t program = 0;
    children >> program;
    return program;
  }
  // Unmounts, stops the endpoint and checks the server ends with 0; ready for the next mode.
  void UnmountAndExpectCleanExit() {
    ASSERT_EQ(Unmount(MNT_DETACH), 0);
    lt_.RunOnLoop([&] { endpoint_->Stop(); });
    EXPECT_EQ(ServerExit(), 0) << server_->Stderr();
    endpoint_.reset();
  }
  int ServerExit() {
    auto st = server_->Wait(std::chrono::milliseconds(20000));
    EXPECT_TRUE(st.has_value());
    return st && WIFEXITED(*st) ? WEXITSTATUS(*st) : -1;
  }

  TmpfsDir root_;
  std::string export_, mnt_, sockdir_;
  LoopThread lt_;
  std::shared_ptr<HandoffEndpoint> endpoint_;
  std::promise<void> served_;
  absl::Status last_error_;
  std::promise<absl::Status> gone_;
  std::promise<std::string> notice_;
  bool noticed_ = false;
  std::unique_ptr<Subprocess> server_;
  bool refuse_io_uring_ = false;  // the server runs under a seccomp filter that refuses io_uring
};

TEST_F(FkserveTest, ServesAPassthroughReadsWritesDirsRenamesXattrs) {
  MountAndOffer({.volume_id = "v-pass"});
  StartServer({"serve", "--root=" + export_});
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  EXPECT_EQ(ReadFile(mnt_ + "/existing.txt"), "already here\n");
  { std::ofstream(mnt_ + "/new.txt") << "written through FUSE\n"; }
  EXPECT_EQ(ReadFile(export_ + "/new.txt"), "written through FUSE\n");
  ASSERT_TRUE(fs::create_directory(mnt_ + "/dir"));
  fs::rename(mnt_ + "/new.txt", mnt_ + "/dir/moved.txt");
  EXPECT_TRUE(fs::exists(export_ + "/dir/moved.txt"));
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(mnt_)) names.insert(e.path().filename());
  EXPECT_EQ(names, (std::set<std::string>{"existing.txt", "dir"}));
  const std::string file = mnt_ + "/existing.txt";
  if (setxattr(file.c_str(), "user.fk", "1", 1, 0) == 0) {
    char v[8] = {};
    EXPECT_EQ(getxattr(file.c_str(), "user.fk", v, sizeof(v)), 1);
    EXPECT_EQ(v[0], '1');
  } else {
    EXPECT_EQ(errno, EOPNOTSUPP) << "tmpfs without user xattrs";
  }
  fs::remove(mnt_ + "/dir/moved.txt");
  EXPECT_FALSE(fs::exists(export_ + "/dir/moved.txt"));
  ASSERT_EQ(Unmount(0), 0) << strerror(errno);
  lt_.RunOnLoop([&] { endpoint_->Stop(); });  // drops the agent's dup: the connection ends
  EXPECT_EQ(ServerExit(), 0) << server_->Stderr();
}

TEST_F(FkserveTest, RunsUnprivilegedAndPresentsTheMountGroup) {
  fs::permissions(export_, fs::perms::all);
  chown(export_.c_str(), 65534, 65534);
  chown((export_ + "/existing.txt").c_str(), 65534, 65534);
  chmod((export_ + "/existing.txt").c_str(), 0600);
  MountConfig config{.volume_id = "v-group"};
  config.mount_group = 4321;
  MountAndOffer(config, false, /*server_uid=*/65534);
  StartServer({"serve", "--root=" + export_}, /*uid=*/65534);
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  struct stat st;
  ASSERT_EQ(stat((mnt_ + "/existing.txt").c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, 4321u) << "presented with the pod's fsGroup";
  EXPECT_EQ(st.st_mode & 0070, 0060u) << "group gets the owner's rights";
  // The real file is untouched, and files the server creates belong to its own user.
  struct stat real;
  ASSERT_EQ(stat((export_ + "/existing.txt").c_str(), &real), 0);
  EXPECT_EQ(real.st_gid, 65534u);
  { std::ofstream(mnt_ + "/by-pod.txt") << "x"; }
  ASSERT_EQ(stat((export_ + "/by-pod.txt").c_str(), &real), 0);
  EXPECT_EQ(real.st_uid, 65534u) << "the server wrote it, unprivileged";
}

TEST_F(FkserveTest, ReadOnlyVolumesRefuseWrites) {
  MountAndOffer({.volume_id = "v-ro", .read_only = true}, /*read_only=*/true);
  StartServer({"serve", "--root=" + export_});
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  EXPECT_EQ(ReadFile(mnt_ + "/existing.txt"), "already here\n");
  EXPECT_LT(open((mnt_ + "/nope").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644), 0);
  EXPECT_EQ(errno, EROFS);
}

TEST_F(FkserveTest, LaunchesAnUnmodifiedLibfuse3ProgramOnDevFd) {
  MountAndOffer({.volume_id = "v-launch"});
  StartServer({"launch", "--", RunfilePath("tests/testing/hello_fuse"), "/dev/fd/{fd}", "launched\n"});
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  EXPECT_EQ(ReadFile(mnt_ + "/hello"), "launched\n");
  ASSERT_EQ(Unmount(0), 0);
  lt_.RunOnLoop([&] { endpoint_->Stop(); });
  EXPECT_EQ(ServerExit(), 0) << "the program's exit status is fkserve's: " << server_->Stderr();
}

// Relayed (the default), the program's connection is a socket the launcher relays; with
// --direct, the agent's /dev/fuse connection itself.
// Relayed (the default), a dynamically linked program reads the kernel's connection itself with
// the relay's core in it (relay/in_program.h); --in_program=false relays it through the launcher
// (the program holds a socket); --direct hands it the device without a relay.
TEST_F(FkserveTest, LaunchRelaysByDefaultAndHandsTheDeviceOverWithDirect) {
  for (const Mode mode : {kInProgram, kHop, kDirect}) {
    const char* name = ModeName(mode);
    SCOPED_TRACE(name);
    StartMode(mode, "v-", "x\n");
    ASSERT_TRUE(WaitServed()) << server_->Stderr();
    EXPECT_EQ(ReadFile(mnt_ + "/hello"), "x\n");
    std::ifstream children("/proc/" + std::to_string(server_->pid()) + "/task/" + std::to_string(server_->pid()) +
                           "/children");
    pid_t program = 0;
    ASSERT_TRUE(children >> program);
    std::vector<std::string> fds;
    for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(program) + "/fd")) {
      fds.push_back(fs::read_symlink(e.path()).string());
    }
    const bool has_device = std::count(fds.begin(), fds.end(), "/dev/fuse") > 0;
    const bool says_in_program = server_->Stderr().find("reads the kernel's connection itself") != std::string::npos;
    EXPECT_EQ(has_device, mode != kHop) << "only through the launcher's hop does the program hold no device";
    // Relayed, the preload library is in the program, even given /dev/fd/{fd}: on the hop it makes
    // a spliced reply one socket message.
    const std::string maps = ReadFile("/proc/" + std::to_string(program) + "/maps");
    EXPECT_EQ(maps.find("libfkserve_preload.so") != std::string::npos, mode != kDirect) << name;
    EXPECT_EQ(says_in_program, mode == kInProgram) << server_->Stderr();
    ASSERT_EQ(Unmount(MNT_DETACH), 0);
    lt_.RunOnLoop([&] { endpoint_->Stop(); });
    EXPECT_EQ(ServerExit(), 0) << server_->Stderr();
    endpoint_.reset();
  }
}

// A program that splices its READ replies (libfuse's FUSE_CAP_SPLICE_WRITE, as fuse-overlayfs):
// relayed in the program (where the library splices them on to the kernel), on the hop, and
// direct, a file of 4 MiB reads back byte for byte, and on again after the program is killed
// under a reader holding it open.
TEST_F(FkserveTest, SplicedReadRepliesArriveWholeInEveryMode) {
  constexpr size_t kBytes = 4 << 20;
  const std::string want = SplicedContent(kBytes);
  for (const Mode mode : {kInProgram, kHop, kDirect}) {
    SCOPED_TRACE(ModeName(mode));
    StartMode(mode, "v-splice-", std::string(kSpliceContent) + std::to_string(kBytes));
    ASSERT_TRUE(WaitServed()) << server_->Stderr();
    const std::string file = mnt_ + "/hello";
    UniqueFd held(open(file.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(held.valid()) << strerror(errno) << server_->Stderr();
    auto read_all = [&] {
      posix_fadvise(held.get(), 0, 0, POSIX_FADV_DONTNEED);
      std::string got(kBytes, '\0');
      size_t done = 0;
      while (done < kBytes) {
        const ssize_t n = pread(held.get(), got.data() + done, kBytes - done, static_cast<off_t>(done));
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      got.resize(done);
      return got;
    };
    EXPECT_TRUE(read_all() == want) << "the file read back differs" << server_->Stderr();
    if (mode != kDirect) {
      const pid_t program = LaunchedProgram();
      ASSERT_GT(program, 0);
      ASSERT_EQ(kill(program, SIGKILL), 0);
      auto again = WithDeadline([&] { return read_all() == want; });
      ASSERT_TRUE(again.has_value()) << "the read waits on\n" << server_->Stderr();
      EXPECT_TRUE(*again) << "read after the kill differs" << server_->Stderr();
    }
    EXPECT_EQ(server_->CountInStderr("failed with"), 0) << server_->Stderr();
    held.Reset();
    UnmountAndExpectCleanExit();
  }
}

// A program's process that outlives its launcher (a daemonized one outside a container, or one
// forked just as the launcher was killed) must not serve on with the relay's core in it: the
// next launcher starts an instance of its own, and two cores on one connection lose each
// other's file handles (seen: READ of a handle "the relay never issued" after launcher kills).
TEST_F(FkserveTest, AnInstanceWhoseLauncherDiedStopsServing) {
  MountAndOffer({.volume_id = "v-orphan"});
  // The shell is the launcher's child (it dies with it); the program is the shell's.
  StartServer({"launch", "--", "/bin/sh", "-c", RunfilePath("tests/testing/hello_fuse") + " /dev/fd/{fd} x & wait"});
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  EXPECT_EQ(ReadFile(mnt_ + "/hello"), "x");
  ASSERT_TRUE(server_->WaitForStderr("reads the kernel's connection itself", 1, kTestDeadline)) << server_->Stderr();
  const std::string sh = std::to_string(server_->pid());
  pid_t shell = 0, program = 0;
  {
    std::ifstream children("/proc/" + sh + "/task/" + sh + "/children");
    ASSERT_TRUE(children >> shell);
  }
  {
    std::ifstream children("/proc/" + std::to_string(shell) + "/task/" + std::to_string(shell) + "/children");
    ASSERT_TRUE(children >> program);
  }
  // Readable once the program has ended (it is not our child: no wait).
  UniqueFd ended(static_cast<int>(syscall(SYS_pidfd_open, program, 0)));
  ASSERT_TRUE(ended.valid()) << strerror(errno);
  server_->Signal(SIGKILL);
  ASSERT_TRUE(server_->Wait(std::chrono::milliseconds(20000)).has_value());
  pollfd p{ended.get(), POLLIN, 0};
  const bool gone = poll(&p, 1, static_cast<int>(std::chrono::milliseconds(kTestDeadline).count())) == 1;
  EXPECT_TRUE(gone) << "the program serves on without its launcher";
  if (!gone) kill(program, SIGKILL);
}

// Under a seccomp filter that refuses io_uring (the container runtimes' default profiles):
// `fkserve serve` serves, and `fkserve launch` relays (its loop waits with epoll), in the program
// and on the hop; a program killed under a reader holding the file open is restarted and the
// reader reads on, the same bytes.
TEST_F(FkserveTest, ServesAndRelaysWhereIoUringIsRefused) {
  refuse_io_uring_ = true;
  for (const Mode mode : {kServe, kInProgram, kHop}) {
    SCOPED_TRACE(ModeName(mode));
    StartMode(mode, "v-ring-", "x\n");
    ASSERT_TRUE(WaitServed()) << server_->Stderr();
    const std::string file = mnt_ + (mode == kServe ? "/existing.txt" : "/hello");
    const std::string want = mode == kServe ? "already here\n" : "x\n";
    UniqueFd held(open(file.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(held.valid()) << strerror(errno) << server_->Stderr();
    char buf[64];
    ASSERT_EQ(pread(held.get(), buf, sizeof(buf), 0), static_cast<ssize_t>(want.size()));
    if (mode != kServe) {
      EXPECT_EQ(server_->CountInStderr("waiting with epoll"), 1) << server_->Stderr();
      const pid_t program = LaunchedProgram();
      ASSERT_GT(program, 0);
      ASSERT_EQ(kill(program, SIGKILL), 0);
      ASSERT_TRUE(server_->WaitForStderr("the relay keeps the connection: restarting it", 1, kTestDeadline))
          << server_->Stderr();
    }
    auto read_again = WithDeadline([&] { return pread(held.get(), buf, sizeof(buf), 0); });
    ASSERT_TRUE(read_again.has_value()) << "the read waits on\n" << server_->Stderr();
    ASSERT_EQ(*read_again, static_cast<ssize_t>(want.size())) << strerror(errno) << server_->Stderr();
    EXPECT_EQ(std::string(buf, want.size()), want);
    EXPECT_EQ(ReadFile(file), want);
    if (mode != kServe) {
      EXPECT_TRUE(server_->WaitForStderr("(1 restart(s) so far)", 1, kTestDeadline)) << server_->Stderr();
    }
    held.Reset();
    UnmountAndExpectCleanExit();
  }
}

// In its container fkserve is PID 1, which ignores any signal it has no handler for: without
// handlers kubelet's SIGTERM was waited out for the whole grace period (30 s) at every pod
// deletion (issue 18 item 4). Here it runs as PID 1 of a pid namespace of its own.
TEST_F(FkserveTest, AsPidOneItStopsWhenAskedInServeAndLaunchMode) {
  const std::vector<std::string> pid_one = {"/usr/bin/unshare", "--pid", "--fork", "--kill-child=SIGKILL"};
  struct Mode {
    const char* name;
    std::vector<std::string> args;
  };
  const Mode modes[] = {
      {"serve", {"serve", "--root=" + export_}},
      {"launch", {"launch", "--", RunfilePath("tests/testing/hello_fuse"), "/dev/fd/{fd}", "launched\n"}},
  };
  for (const Mode& m : modes) {
    served_ = std::promise<void>();
    gone_ = std::promise<absl::Status>();
    MountAndOffer({.volume_id = std::string("v-term-") + m.name});
    StartServer(m.args, 0, pid_one);
    ASSERT_TRUE(WaitServed()) << m.name << ": " << server_->Stderr();
    // fkserve is the only child of unshare.
    std::ifstream children("/proc/" + std::to_string(server_->pid()) + "/task/" + std::to_string(server_->pid()) +
                           "/children");
    pid_t fkserve = 0;
    children >> fkserve;
    ASSERT_GT(fkserve, 0) << m.name;
    ASSERT_EQ(kill(fkserve, SIGTERM), 0);
    auto st = server_->Wait(std::chrono::milliseconds(std::chrono::milliseconds(kTestDeadline)));
    ASSERT_TRUE(st.has_value()) << m.name << ": fkserve as PID 1 ignored SIGTERM\n" << server_->Stderr();
    ASSERT_EQ(Unmount(MNT_DETACH), 0);
    lt_.RunOnLoop([&] { endpoint_->Stop(); });
    endpoint_.reset();
  }
}

// Issue 19: a libfuse2 program that daemonizes (bindfs without -f), given an ordinary directory,
// mounts it through fkserve's fusermount and serves the agent's connection.
TEST_F(FkserveTest, ALibfuse2ProgramMountsADirectoryThroughOurFusermount) {
  if (access("/usr/bin/bindfs", X_OK) != 0) GTEST_SKIP() << "bindfs is not installed (scripts/setup.sh installs it)";
  MountAndOffer({.volume_id = "v-bindfs"}, false, 65534);
  chown(export_.c_str(), 65534, 65534);
  chown((export_ + "/existing.txt").c_str(), 65534, 65534);
  StartServer({"launch", "--", "bindfs", "-o", "ro,suid", export_, "{mountpoint}"}, 65534);
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  auto got = WithDeadline([&] { return ReadFile(mnt_ + "/existing.txt"); });
  ASSERT_TRUE(got.has_value()) << server_->Stderr();
  EXPECT_EQ(*got, "already here\n") << server_->Stderr();
  // The options it asked for that the agent's mount does not have reach the agent at once.
  auto notice = notice_.get_future();
  ASSERT_EQ(notice.wait_for(kTestDeadline), std::future_status::ready) << server_->Stderr();
  const std::string n = notice.get();
  EXPECT_NE(n.find("bindfs: fusermount options not applied: ro (the agent mounted the volume read-write)"),
            std::string::npos) << n;
}

TEST_F(FkserveTest, ALaunchedProgramsExitStatusReachesTheAgent) {
  MountAndOffer({.volume_id = "v-exit"});
  StartServer({"launch", "--", "/bin/sh", "-c", "exit 3", "/dev/fd/{fd}"});
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  EXPECT_EQ(ServerExit(), 3);
  auto gone = gone_.get_future();
  ASSERT_EQ(gone.wait_for(kTestDeadline), std::future_status::ready);
  absl::Status why = gone.get();
  EXPECT_NE(why.message().find("exited with status 3"), std::string::npos) << why;
}

// Issue 20: relayed, a program that served and then dies is restarted with the connection kept;
// one that keeps dying young is given up on after --max_restarts, and its end (with the reason)
// is reported to the agent as for a program that was never relayed. Nothing is left running.
TEST_F(FkserveTest, ARelayedProgramThatKeepsDyingIsGivenUpOnAndReported) {
  MountAndOffer({.volume_id = "v-crashloop"});
  const std::string marker = export_ + "/served-once";
  const std::string script = "if [ -e " + marker + " ]; then echo cannot start again >&2; exit 7; fi; touch " + marker +
                             "; exec " + RunfilePath("tests/testing/hello_fuse") + " /dev/fd/{fd} first";
  StartServer({"--max_restarts=3", "launch", "--", "/bin/sh", "-c", script});
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  EXPECT_EQ(ReadFile(mnt_ + "/hello"), "first");
  // The program that served dies; every restart exits at once.
  {
    std::ifstream children("/proc/" + std::to_string(server_->pid()) + "/task/" + std::to_string(server_->pid()) +
                           "/children");
    pid_t program = 0;
    ASSERT_TRUE(children >> program) << "the launcher's program";
    ASSERT_EQ(kill(program, SIGKILL), 0);
  }
  EXPECT_EQ(ServerExit(), 7) << server_->Stderr();
  auto gone = gone_.get_future();
  ASSERT_EQ(gone.wait_for(kTestDeadline), std::future_status::ready);
  const absl::Status why = gone.get();
  EXPECT_NE(why.message().find("exited with status 7; gave up after 3 restarts in a row that each died before answering"), std::string::npos) << why;
  EXPECT_NE(why.message().find("cannot start again"), std::string::npos) << "its last words: " << why;
  EXPECT_EQ(server_->CountInStderr("restarting it"), 4) << "the one that served, then 3 that never answered\n"
                                                        << server_->Stderr();
  EXPECT_NE(server_->Stderr().find("restarting it in 200 ms"), std::string::npos) << "a growing delay";
}

// A restart that cannot start the program (its binary is gone) is a death like any other: it is
// retried with the others, and the report says why, not a status of an instance that never ran.
TEST_F(FkserveTest, ARestartThatCannotStartTheProgramIsReportedAsSuch) {
  MountAndOffer({.volume_id = "v-gone"});
  const std::string program = root_.path() + "/hello-copy";
  fs::copy_file(RunfilePath("tests/testing/hello_fuse"), program);
  StartServer({"--max_restarts=2", "launch", "--", program, "/dev/fd/{fd}", "x\n"});
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  EXPECT_EQ(ReadFile(mnt_ + "/hello"), "x\n");
  ASSERT_EQ(unlink(program.c_str()), 0);
  std::ifstream children("/proc/" + std::to_string(server_->pid()) + "/task/" + std::to_string(server_->pid()) +
                         "/children");
  pid_t running = 0;
  ASSERT_TRUE(children >> running);
  ASSERT_EQ(kill(running, SIGKILL), 0);
  EXPECT_EQ(ServerExit(), 127) << server_->Stderr();
  auto gone = gone_.get_future();
  ASSERT_EQ(gone.wait_for(kTestDeadline), std::future_status::ready);
  const absl::Status why = gone.get();
  EXPECT_NE(why.message().find("restarting " + program + ": could not start " + program), std::string::npos) << why;
  EXPECT_NE(why.message().find("gave up after 2 restarts"), std::string::npos) << why;
  EXPECT_EQ(why.message().find("exited with status 0"), std::string::npos) << why;
}

// Issue 27 part 3: relayed, a program that takes the connection and never answers the kernel's
// FUSE_INIT (here it never reads its /dev/fd at all, and leaves a second process behind) kept
// the launcher and every access to the mount waiting forever. Now, past --init_timeout_ms, every
// process of it is killed and its end is reported as a program's that ended before serving.
TEST_F(FkserveTest, ARelayedProgramThatNeverAnswersInitIsKilledAndReported) {
  MountAndOffer({.volume_id = "v-silent"});
  StartServer({"--init_timeout_ms=300", "launch", "--", "/bin/sh", "-c",
               "(sleep 3600 &); echo waiting for nothing >&2; exec sleep 3600", "/dev/fd/{fd}"});
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  auto status = server_->Wait(std::chrono::milliseconds(20000));
  ASSERT_TRUE(status.has_value()) << "the launcher still waits for its silent program\n" << server_->Stderr();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 128 + SIGKILL) << *status << server_->Stderr();
  auto gone = gone_.get_future();
  ASSERT_EQ(gone.wait_for(kTestDeadline), std::future_status::ready);
  const absl::Status why = gone.get();
  EXPECT_NE(why.message().find("sh did not answer the kernel's FUSE_INIT within 300 ms of its start; fkserve killed it"),
            std::string::npos) << why;
  EXPECT_NE(why.message().find("its last words: waiting for nothing"), std::string::npos) << why;
  EXPECT_NE(server_->Stderr().find("killing it (2 process(es))"), std::string::npos) << server_->Stderr();
}

// Relayed, a program that served and then stops answering altogether (stopped here with
// SIGSTOP) while a request waits on it is killed after --program_stall_ms: the relay restarts it
// and resends the request, which is answered; the agent is told why.
TEST_F(FkserveTest, ARelayedProgramThatStopsAnsweringIsKilledAndRestartedAndItsRequestAnswered) {
  MountAndOffer({.volume_id = "v-stall"});
  StartServer({"--program_stall_ms=500", "launch", "--", RunfilePath("tests/testing/hello_fuse"), "/dev/fd/{fd}",
               "x\n"});
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  EXPECT_EQ(ReadFile(mnt_ + "/hello"), "x\n");
  {
    std::ifstream children("/proc/" + std::to_string(server_->pid()) + "/task/" + std::to_string(server_->pid()) +
                           "/children");
    pid_t program = 0;
    ASSERT_TRUE(children >> program) << "the launcher's program";
    ASSERT_EQ(kill(program, SIGSTOP), 0);
    // kill() returns before every thread has stopped; one that still runs may answer the request
    // below. The launcher is told (SIGCHLD, CLD_STOPPED) once every thread has, and says so.
    ASSERT_TRUE(server_->WaitForStderr("was stopped by signal 19", 1, kTestDeadline))
        << "the program did not stop: its threads are " << ThreadStates(program) << "\n" << server_->Stderr();
  }
  const std::string file = mnt_ + "/hello";
  auto answered = WithDeadline([&] {
    struct statx stx;
    return statx(AT_FDCWD, file.c_str(), AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, &stx) == 0 ? 0 : errno;
  });
  ASSERT_TRUE(answered.has_value()) << "the request still waits on the stopped program\n" << server_->Stderr();
  EXPECT_EQ(*answered, 0) << strerror(*answered);
  auto notice = notice_.get_future();
  ASSERT_EQ(notice.wait_for(kTestDeadline), std::future_status::ready) << server_->Stderr();
  const std::string text = notice.get();
  // (The statx's GETATTR, and whatever else the kernel had sent meanwhile: a RELEASE of the read.)
  EXPECT_NE(text.find("stopped answering: "), std::string::npos) << text;
  EXPECT_NE(text.find(" request(s) in flight to it and no message from it for"), std::string::npos) << text;
  EXPECT_NE(text.find("the relay restarts it and resends"), std::string::npos) << text;
  // Its stderr is read on a thread of the test's: the line may trail the agent's notice.
  EXPECT_TRUE(server_->WaitForStderr("restarting it", 1, std::chrono::milliseconds(20000))) << server_->Stderr();
  EXPECT_EQ(server_->CountInStderr("restarting it"), 1) << server_->Stderr();
  EXPECT_EQ(ReadFile(mnt_ + "/hello"), "x\n");
}

// A program working on a long request (here a READ it answers after 3 s of CPU, as an upload
// at FLUSH moves bytes) sends nothing meanwhile: busy, not hung. However short
// --program_stall_ms is, it is not killed; a stopped one is (the test above). In the program and
// on the launcher's hop.
TEST_F(FkserveTest, ARelayedProgramBusyWithALongRequestIsNotKilledAsHung) {
  for (const bool hop : {false, true}) {
    SCOPED_TRACE(hop ? "hop" : "in the program");
    served_ = std::promise<void>();
    MountAndOffer({.volume_id = hop ? "v-busy-hop" : "v-busy"});
    // Work three times the bound: a stall watch that did not see it would kill the program at
    // each try (the relay and the work sampler look every eighth of the bound).
    std::vector<std::string> args = {"--program_stall_ms=1000", "launch", "--", RunfilePath("tests/testing/hello_fuse"),
                                     "/dev/fd/{fd}", "x\n", "3000"};
    if (hop) args.insert(args.begin(), "--in_program=false");
    StartServer(args);
    ASSERT_TRUE(WaitServed()) << server_->Stderr();
    auto read = WithDeadline([&] { return ReadFile(mnt_ + "/hello"); });
    ASSERT_TRUE(read.has_value()) << "killed as hung under its work, and given up on\n" << server_->Stderr();
    EXPECT_EQ(*read, "x\n") << server_->Stderr();
    EXPECT_EQ(server_->CountInStderr("stopped answering"), 0) << server_->Stderr();
    EXPECT_EQ(server_->CountInStderr("restarting it"), 0) << server_->Stderr();
    UnmountAndExpectCleanExit();
  }
}

TEST_F(FkserveTest, LaunchOfAMissingProgramIsReportedToTheAgent) {
  MountAndOffer({.volume_id = "v-missing"});
  StartServer({"launch", "--", "/nonexistent/fuse-program", "/dev/fd/{fd}"});
  EXPECT_EQ(ServerExit(), 127);
  EXPECT_NE(server_->Stderr().find("could not start /nonexistent/fuse-program"), std::string::npos);
  lt_.RunOnLoop([&] {
    EXPECT_FALSE(endpoint_->served());
    EXPECT_NE(last_error_.message().find("could not start"), std::string::npos) << last_error_;
  });
}

// A server pod starts before the agent has found its emptyDir: fkserve waits for the socket.
TEST_F(FkserveTest, AServerStartedBeforeItsSocketExistsWaitsForIt) {
  StartServer({"serve", "--root=" + export_});  // no socket yet
  ASSERT_TRUE(server_->WaitForStderr("waiting up to", 1, kTestDeadline)) << server_->Stderr();
  MountAndOffer({.volume_id = "v-late"});
  ASSERT_TRUE(WaitServed()) << server_->Stderr();
  EXPECT_EQ(ReadFile(mnt_ + "/existing.txt"), "already here\n");
}

TEST_F(FkserveTest, ClearErrorsForAMissingSocketAWrongPeerAndANonFuseFd) {
  StartServer({"--socket_wait_ms=0", "serve", "--root=" + export_});  // no endpoint yet: nothing listens
  EXPECT_EQ(ServerExit(), 3);
  EXPECT_NE(server_->Stderr().find("cannot connect"), std::string::npos) << server_->Stderr();

  MountAndOffer({.volume_id = "v-peer"});
  StartServer({"--agent_uid=4242", "serve", "--root=" + export_});
  EXPECT_EQ(ServerExit(), 3);
  EXPECT_NE(server_->Stderr().find("not the agent"), std::string::npos) << server_->Stderr();

  // A fake "agent" that hands over /dev/null instead of a FUSE connection.
  lt_.RunOnLoop([&] { endpoint_->Stop(); });
  endpoint_.reset();
  fs::remove(sockdir_ + "/s");
  UniqueFd dir(open(sockdir_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  auto listen = HandoffEndpoint::ListenBlocking(dir.get(), "s", 0, 0);
  ASSERT_TRUE(listen.ok());
  lt_.RunOnLoop([&] {
    endpoint_ = HandoffEndpoint::Start(lt_.loop(), std::move(*listen),
                                       UniqueFd(open("/dev/null", O_RDWR | O_CLOEXEC)),
                                       {.volume_id = "v-fake"}, {}, {});
  });
  StartServer({"serve", "--root=" + export_});
  EXPECT_EQ(ServerExit(), 4);
  EXPECT_NE(server_->Stderr().find("not carry a /dev/fuse fd"), std::string::npos) << server_->Stderr();
}

}  // namespace
}  // namespace fusekeeper
