#include "agent/fuse/handoff_endpoint.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <future>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/loop_thread.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;

UniqueFd Connect(const std::string& path) {
  UniqueFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  EXPECT_LT(path.size(), sizeof(a.sun_path));
  strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  EXPECT_EQ(connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << strerror(errno);
  return s;
}

class HandoffEndpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_fd_.Reset(open(dir_.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    int p[2];
    ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
    fake_fuse_.Reset(p[0]);
    pipe_w_.Reset(p[1]);
    config_.volume_id = "vol-h";
    config_.gid = 1000;
    config_.volume_context = {{"bucket", "b"}};
  }
  void TearDown() override {
    if (endpoint_) lt_.RunOnLoop([&] { endpoint_->Stop(); });
    endpoint_.reset();
    lt_.StopAndJoin();
  }
  // Starts an endpoint at dir_/sock; events arrive in the promises below.
  // `with_connection` false: as after an agent restart, the endpoint holds no connection.
  void StartEndpoint(HandoffOptions options = {}, bool with_connection = true) {
    lt_.RunOnLoop([&] {
      auto listen = HandoffEndpoint::ListenBlocking(dir_fd_.get(), "sock", getuid(), getgid());
      ASSERT_TRUE(listen.ok()) << listen.status();
      UniqueFd dup_fd(with_connection ? fcntl(fake_fuse_.get(), F_DUPFD_CLOEXEC, 0) : -1);
      HandoffEndpoint::Events events;
      events.on_served = [this](const HandoffReply& r, pid_t pid) {
        served_.push_back({r.server, pid});
        if (served_.size() == 1) served_cv_.set_value();  // the first serving
      };
      events.on_server_gone = [this](const absl::Status& s) {
        gone_.push_back(s);
        if (gone_waiter_) std::exchange(gone_waiter_, nullptr)->set_value(s);
      };
      events.on_connection_error = [this](const absl::Status& s) {
        errors_.push_back(s);
        if (error_waiter_) std::exchange(error_waiter_, nullptr)->set_value(s);
      };
      events.on_fresh_requested = [this, held = sentinel_] { ++fresh_requested_; };
      endpoint_ = HandoffEndpoint::Start(lt_.loop(), std::move(*listen), std::move(dup_fd), config_,
                                         options, std::move(events));
    });
  }
  std::future<absl::Status> NextError() {
    auto p = std::make_shared<std::promise<absl::Status>>();
    auto f = p->get_future();
    lt_.RunOnLoop([&] { error_waiter_ = p; });
    return f;
  }
  std::string SockPath() { return dir_.path() + "/sock"; }

  ShortTempDir dir_;
  UniqueFd dir_fd_, fake_fuse_, pipe_w_;
  MountConfig config_;
  LoopThread lt_;
  std::shared_ptr<HandoffEndpoint> endpoint_;
  // Held by the endpoint's events only (and here, until a test lets go): it dies with the endpoint.
  std::shared_ptr<int> sentinel_ = std::make_shared<int>(0);
  std::vector<std::pair<std::string, pid_t>> served_;
  std::promise<void> served_cv_;
  std::vector<absl::Status> errors_;
  std::shared_ptr<std::promise<absl::Status>> error_waiter_;
  std::vector<absl::Status> gone_;
  int fresh_requested_ = 0;
  std::shared_ptr<std::promise<absl::Status>> gone_waiter_;

  std::future<absl::Status> NextGone() {
    auto p = std::make_shared<std::promise<absl::Status>>();
    auto f = p->get_future();
    lt_.RunOnLoop([&] { gone_waiter_ = p; });
    return f;
  }
  // Connects, takes the volume, says ok; returns the open connection.
  UniqueFd Serve() {
    UniqueFd s = Connect(SockPath());
    auto m = ReceiveHandoffMessage(s.get());
    EXPECT_TRUE(m.ok() && m->fd.valid());
    EXPECT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply({.ok = true}), -1).ok());
    return s;
  }
};

TEST_F(HandoffEndpointTest, SocketIsPrivateToTheServersUser) {
  StartEndpoint();
  struct stat st;
  ASSERT_EQ(lstat(SockPath().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, getuid());
}

TEST_F(HandoffEndpointTest, HandsConfigAndFdToTheServerThenRefusesASecond) {
  StartEndpoint();
  UniqueFd s = Connect(SockPath());
  auto m = ReceiveHandoffMessage(s.get());
  ASSERT_TRUE(m.ok()) << m.status();
  auto config = DecodeMountConfig(m->payload);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->volume_id, "vol-h");
  EXPECT_EQ(config->gid, 1000u);
  EXPECT_EQ(config->volume_context.at("bucket"), "b");
  ASSERT_TRUE(m->fd.valid());
  struct stat a, b;
  ASSERT_EQ(fstat(m->fd.get(), &a), 0);
  ASSERT_EQ(fstat(fake_fuse_.get(), &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino) << "the server received the volume's connection";
  ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply({.ok = true, .server = "test-server"}), -1).ok());
  ASSERT_EQ(served_cv_.get_future().wait_for(kTestDeadline), std::future_status::ready);
  lt_.RunOnLoop([&] {
    EXPECT_TRUE(endpoint_->served());
    ASSERT_EQ(served_.size(), 1u);
    EXPECT_EQ(served_[0].first, "test-server");
    EXPECT_EQ(served_[0].second, getpid());
  });
  // A second server is turned away, and gets no fd.
  auto err = NextError();
  UniqueFd s2 = Connect(SockPath());
  auto m2 = ReceiveHandoffMessage(s2.get());
  ASSERT_TRUE(m2.ok()) << m2.status();
  EXPECT_FALSE(m2->fd.valid());
  EXPECT_EQ(DecodeMountConfig(m2->payload).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(m2->payload.find("already being served"), std::string::npos);
  ASSERT_EQ(err.wait_for(kTestDeadline), std::future_status::ready);
}

// A server killed right after it sent something (the agent re-arms its receive once it has
// handled that) while its successor connects: the successor reaches the agent in the same turn of
// its loop, before the ring tells of the first one's end. It is not refused as a second server
// (the soak test's kill 531 of 1000, with passthrough requests on the connection).
TEST_F(HandoffEndpointTest, ASuccessorArrivingBeforeItsPredecessorsEndIsServed) {
  StartEndpoint();
  UniqueFd first = Serve();
  ASSERT_EQ(served_cv_.get_future().wait_for(kTestDeadline), std::future_status::ready);
  // The loop is held while the first server says something and goes, and the second connects.
  std::promise<void> holding, release;
  ASSERT_TRUE(lt_.loop().Post([&] {
    holding.set_value();
    release.get_future().wait();
  }));
  holding.get_future().wait();
  ASSERT_TRUE(SendHandoffMessage(first.get(), EncodeHandoffReply({.ok = true, .notice = "still here"}), -1).ok());
  first.Reset();
  UniqueFd second = Connect(SockPath());
  release.set_value();
  auto m = ReceiveHandoffMessage(second.get());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->fd.valid()) << "refused: " << m->payload;
  EXPECT_TRUE(DecodeMountConfig(m->payload).ok()) << m->payload;
}

// A server that stops cleanly with an answer of the agent's unread (here a passthrough refusal)
// resets the connection: the kernel reports that to the agent's receive before the server's last
// word, which is still there. A clean stop is still a clean stop (no crash Warning on a pod
// deletion: the sidecar stopped at SIGTERM with a passthrough close answered but unread).
TEST_F(HandoffEndpointTest, AStopWithAnAnswerUnreadIsStillACleanStop) {
  StartEndpoint();
  UniqueFd s = Serve();
  ASSERT_EQ(served_cv_.get_future().wait_for(kTestDeadline), std::future_status::ready);
  ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeBackingRequest(BackingRequest{1, false, 7}), -1).ok());
  pollfd p{s.get(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 20000), 1) << "the agent answers (a refusal: it brokers no passthrough)";
  // The loop is held while the server says its last word and goes, the answer unread.
  auto gone = NextGone();
  std::promise<void> holding, release;
  ASSERT_TRUE(lt_.loop().Post([&] {
    holding.set_value();
    release.get_future().wait();
  }));
  holding.get_future().wait();
  ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply({.ok = true}), -1).ok());
  s.Reset();
  release.set_value();
  ASSERT_EQ(gone.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_NE(gone.get().message().find("stopped serving"), std::string::npos) << "not taken for a crash";
}

TEST_F(HandoffEndpointTest, GarbageEarlyCloseAndSilenceAreReportedAndListeningGoesOn) {
  StartEndpoint({.reply_timeout = absl::Milliseconds(100)});
  {  // garbage
    auto err = NextError();
    UniqueFd s = Connect(SockPath());
    ASSERT_TRUE(ReceiveHandoffMessage(s.get()).ok());
    ASSERT_TRUE(SendHandoffMessage(s.get(), "this is not json", -1).ok());
    ASSERT_EQ(err.wait_for(kTestDeadline), std::future_status::ready);
    EXPECT_EQ(err.get().code(), absl::StatusCode::kInvalidArgument);
  }
  {  // the server refuses
    auto err = NextError();
    UniqueFd s = Connect(SockPath());
    ASSERT_TRUE(ReceiveHandoffMessage(s.get()).ok());
    ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply({.ok = false, .error = "no bucket"}), -1).ok());
    ASSERT_EQ(err.wait_for(kTestDeadline), std::future_status::ready);
    absl::Status e = err.get();
    EXPECT_EQ(e.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(e.message().find("no bucket"), std::string::npos);
  }
  {  // takes the fd and closes without a word
    auto err = NextError();
    UniqueFd s = Connect(SockPath());
    ASSERT_TRUE(ReceiveHandoffMessage(s.get()).ok());
    s.Reset();
    ASSERT_EQ(err.wait_for(kTestDeadline), std::future_status::ready);
    EXPECT_EQ(err.get().code(), absl::StatusCode::kUnavailable);
  }
  {  // never answers
    auto err = NextError();
    UniqueFd s = Connect(SockPath());
    ASSERT_TRUE(ReceiveHandoffMessage(s.get()).ok());
    ASSERT_EQ(err.wait_for(kTestDeadline), std::future_status::ready);
    EXPECT_EQ(err.get().code(), absl::StatusCode::kDeadlineExceeded);
  }
  // Still listening, and still unserved: a good server gets the volume.
  UniqueFd s = Connect(SockPath());
  auto m = ReceiveHandoffMessage(s.get());
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(m->fd.valid());
  ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply({.ok = true}), -1).ok());
  ASSERT_EQ(served_cv_.get_future().wait_for(kTestDeadline), std::future_status::ready);
}

// Runs body in a child process as uid/gid 65534; returns its exit code (10: could not switch user).
int RunAsNobody(const std::function<int()>& body) {
  pid_t child = fork();
  if (child == 0) {
    if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) _exit(10);
    _exit(body());
  }
  int status = 0;
  if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// connect(2) to a unix socket without allocating (runs in a forked child). -1/errno on failure.
int RawConnect(const char* path) {
  int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  strncpy(a.sun_path, path, sizeof(a.sun_path) - 1);
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return -1;
  return s;
}

TEST_F(HandoffEndpointTest, AnotherUserIsRefused) {
  StartEndpoint({.peer_uid = 4242});
  auto err = NextError();
  const std::string path = SockPath();
  // The socket is 0600 and owned by the server's user: others cannot even connect.
  EXPECT_EQ(RunAsNobody([&] { return RawConnect(path.c_str()) < 0 && errno == EACCES ? 0 : 11; }), 0)
      << "another user could connect to the handoff socket";
  // And the uid check itself: make the socket reachable, then try again.
  ASSERT_EQ(chmod(path.c_str(), 0666), 0);
  ASSERT_EQ(chmod(dir_.path().c_str(), 0711), 0);
  EXPECT_EQ(RunAsNobody([&] {
              int s = RawConnect(path.c_str());
              if (s < 0) return 13;
              char buf[4096];
              char control[CMSG_SPACE(sizeof(int))];
              iovec iov{buf, sizeof(buf)};
              msghdr msg{};
              msg.msg_iov = &iov;
              msg.msg_iovlen = 1;
              msg.msg_control = control;
              msg.msg_controllen = sizeof(control);
              ssize_t n = recvmsg(s, &msg, 0);
              if (n <= 0) return 14;
              if (msg.msg_controllen != 0) return 15;  // received an fd: must not happen
              return memmem(buf, n, "may not serve", 13) != nullptr ? 0 : 16;
            }),
            0);
  ASSERT_EQ(err.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(err.get().code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(HandoffEndpointTest, TheServerGoingAwayIsReportedWithItsWords) {
  StartEndpoint();
  auto gone = NextGone();
  UniqueFd s = Serve();
  ASSERT_EQ(served_cv_.get_future().wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(gone.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout)
      << "serving: nothing gone yet";
  ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply({.ok = false, .error = "prog exited with status 3"}), -1).ok());
  ASSERT_EQ(gone.wait_for(kTestDeadline), std::future_status::ready);
  absl::Status why = gone.get();
  EXPECT_NE(why.message().find("prog exited with status 3"), std::string::npos) << why;
  lt_.RunOnLoop([&] { EXPECT_TRUE(endpoint_->server_gone()); });
}

TEST_F(HandoffEndpointTest, AServerThatDiesWithoutAWordIsReportedToo) {
  StartEndpoint();
  auto gone = NextGone();
  UniqueFd s = Serve();
  s.Reset();  // killed
  ASSERT_EQ(gone.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_NE(gone.get().message().find("closed its connection"), std::string::npos);
}

// A relayed launcher deposits its relay state (a memfd) with its ok reply; when it dies, the next
// server is offered the live connection with that memfd as a second fd (the very same file). A
// server that deposits none (it keeps no state) or something that is not a memfd leaves none for
// its successor. Each gets the connection blocking, whatever the one before did to it.
TEST_F(HandoffEndpointTest, ARelayStateIsKeptAndOfferedToTheNextServer) {
  StartEndpoint();
  // Each server in turn: what it was offered, then it says ok with `deposit` and dies.
  auto serve = [&](int deposit, bool* live, bool* had_state, std::string* state_text) {
    auto gone = NextGone();
    UniqueFd s = Connect(SockPath());
    auto m = ReceiveHandoffMessage(s.get());
    ASSERT_TRUE(m.ok() && m->fd.valid());
    auto config = DecodeMountConfig(m->payload);
    ASSERT_TRUE(config.ok()) << config.status();
    *live = config->live;
    *had_state = config->relay_state;
    EXPECT_EQ(config->relay_state, m->fd2.valid()) << "the flag says whether the fd is there";
    // A relay reads it non-blocking (the open file's flag, shared with the agent's dup): whoever
    // gets it next gets it blocking again.
    EXPECT_EQ(fcntl(m->fd.get(), F_GETFL) & O_NONBLOCK, 0) << "handed over non-blocking";
    fcntl(m->fd.get(), F_SETFL, fcntl(m->fd.get(), F_GETFL) | O_NONBLOCK);
    char buf[16] = {};
    if (m->fd2.valid() && pread(m->fd2.get(), buf, sizeof(buf) - 1, 0) > 0) *state_text = buf;
    HandoffReply ok{.ok = true};
    ok.relay_state = deposit >= 0;
    ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply(ok), deposit).ok());
    s.Reset();  // killed
    ASSERT_EQ(gone.wait_for(kTestDeadline), std::future_status::ready);
  };
  UniqueFd memfd(memfd_create("fkserve-relay-state", MFD_CLOEXEC));
  ASSERT_EQ(write(memfd.get(), "journal", 7), 7);
  bool live = false, had = false;
  std::string text;
  serve(memfd.get(), &live, &had, &text);
  EXPECT_FALSE(live);
  EXPECT_FALSE(had) << "a new connection has no state";
  memfd.Reset();
  serve(-1, &live, &had, &text);
  EXPECT_TRUE(live);
  EXPECT_TRUE(had);
  EXPECT_EQ(text, "journal") << "the state the dead launcher wrote";
  text.clear();
  serve(pipe_w_.get(), &live, &had, &text);
  EXPECT_TRUE(live);
  EXPECT_FALSE(had) << "its predecessor kept no state";
  serve(-1, &live, &had, &text);
  EXPECT_FALSE(had) << "a pipe is not kept as a relay state";
}

TEST_F(HandoffEndpointTest, DirectoryPathsLongerThanSunPathWork) {
  std::string deep = dir_.path();
  while (deep.size() < 200) deep += "/a-rather-long-directory-name";
  fs::create_directories(deep);
  UniqueFd deep_fd(open(deep.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  auto listen = HandoffEndpoint::ListenBlocking(deep_fd.get(), "sock", getuid(), getgid());
  ASSERT_TRUE(listen.ok()) << listen.status();
  EXPECT_TRUE(fs::is_socket(deep + "/sock"));
  // A client reaches it the same way, through its own fd on the directory.
  UniqueFd s = Connect(absl::StrCat("/proc/self/fd/", deep_fd.get(), "/sock"));
  EXPECT_TRUE(s.valid());
}

TEST_F(HandoffEndpointTest, RefusesToReplaceANonSocket) {
  ASSERT_EQ(mkdir((dir_.path() + "/sock").c_str(), 0700), 0);
  auto listen = HandoffEndpoint::ListenBlocking(dir_fd_.get(), "sock", getuid(), getgid());
  EXPECT_EQ(listen.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fs::is_directory(dir_.path() + "/sock"));
}

// A socket file bound at `name` in the test's directory (what a killed agent leaves).
void BindSocketFile(const std::string& path) {
  UniqueFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(a.sun_path));
  strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  ASSERT_EQ(bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << path << ": " << strerror(errno);
}

// An agent killed between its bind and its rename leaves ".<name>.<its pid>.tmp": making the
// socket again, tearing it down and the start-up sweep each remove such names (sockets only).
TEST_F(HandoffEndpointTest, TemporaryNamesAKilledAgentLeftAreRemoved) {
  const std::string d = dir_.path();
  const pid_t dead = getpid() + 1;
  BindSocketFile(d + "/" + HandoffEndpoint::TempSocketName("sock", dead));
  BindSocketFile(d + "/" + HandoffEndpoint::TempSocketName("other", dead));
  { std::ofstream(d + "/" + HandoffEndpoint::TempSocketName("sock", dead + 1)) << "not a socket"; }
  auto listen = HandoffEndpoint::ListenBlocking(dir_fd_.get(), "sock", getuid(), getgid());
  ASSERT_TRUE(listen.ok()) << listen.status();
  EXPECT_TRUE(fs::is_socket(d + "/sock"));
  EXPECT_FALSE(fs::exists(d + "/" + HandoffEndpoint::TempSocketName("sock", dead))) << "made again: its own gone";
  EXPECT_TRUE(fs::exists(d + "/" + HandoffEndpoint::TempSocketName("other", dead))) << "another socket's is not";
  EXPECT_TRUE(fs::is_regular_file(d + "/" + HandoffEndpoint::TempSocketName("sock", dead + 1)))
      << "a file that is not a socket is not ours";

  // Start-up: every other process's, of any socket; this process's own are left alone.
  BindSocketFile(d + "/" + HandoffEndpoint::TempSocketName("mine", getpid()));
  EXPECT_EQ(HandoffEndpoint::RemoveStaleTempSocketsBlocking(dir_fd_.get()), 1);
  EXPECT_FALSE(fs::exists(d + "/" + HandoffEndpoint::TempSocketName("other", dead)));
  EXPECT_TRUE(fs::exists(d + "/" + HandoffEndpoint::TempSocketName("mine", getpid())));

  // Torn down: the socket and every temporary name of it, whoever made it.
  BindSocketFile(d + "/" + HandoffEndpoint::TempSocketName("sock", dead));
  HandoffEndpoint::RemoveSocketBlocking(dir_fd_.get(), "sock");
  EXPECT_FALSE(fs::exists(d + "/sock"));
  EXPECT_FALSE(fs::exists(d + "/" + HandoffEndpoint::TempSocketName("sock", dead)));
  EXPECT_TRUE(fs::exists(d + "/" + HandoffEndpoint::TempSocketName("mine", getpid())));
}

TEST_F(HandoffEndpointTest, StopWithAConnectionInFlightReleasesEverything) {
  StartEndpoint();
  auto err = NextError();
  UniqueFd s = Connect(SockPath());
  ASSERT_TRUE(ReceiveHandoffMessage(s.get()).ok());  // the endpoint now waits for our reply
  std::weak_ptr<int> weak = sentinel_;
  sentinel_.reset();
  int pending = 0;
  lt_.RunOnLoop([&] {
    endpoint_->Stop();
    pending = endpoint_->pending_for_test();
  });
  EXPECT_GT(pending, 0) << "the reply's receive was not in flight: the test shows nothing";
  endpoint_.reset();
  ASSERT_EQ(err.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(err.get().code(), absl::StatusCode::kCancelled);
  lt_.RunOnLoop([] {});
  lt_.RunOnLoop([] {});  // the deferred release has run
  EXPECT_TRUE(weak.expired()) << "the endpoint was not freed";
  // Its dup of the connection is closed: with our pipe's other copies gone, a write now fails.
  s.Reset();
  fake_fuse_.Reset();
  char c = 'x';
  signal(SIGPIPE, SIG_IGN);  // see EPIPE instead of dying of it
  EXPECT_EQ(write(pipe_w_.get(), &c, 1), -1);
  EXPECT_EQ(errno, EPIPE);
}

// After an agent restart a serving server re-deposits its connection; the endpoint takes only
// this volume's /dev/fuse connection.
TEST_F(HandoffEndpointTest, ARedepositedFdThatIsNotTheVolumesConnectionIsRefused) {
  if (access("/dev/fuse", R_OK | W_OK) != 0) GTEST_SKIP() << "no /dev/fuse";
  StartEndpoint({.redeposit_wait = absl::Seconds(10), .expected_connection = 4242}, /*with_connection=*/false);
  HandoffReply redeposit{.ok = true, .server = "test-server", .redeposit = true};
  {  // not /dev/fuse at all
    auto err = NextError();
    UniqueFd s = Connect(SockPath());
    ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply(redeposit), pipe_w_.get()).ok());
    auto m = ReceiveHandoffMessage(s.get());
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_FALSE(m->fd.valid());
    EXPECT_NE(m->payload.find("not /dev/fuse"), std::string::npos) << m->payload;
    ASSERT_EQ(err.wait_for(kTestDeadline), std::future_status::ready);
  }
  {  // /dev/fuse, but not on this volume's connection (not mounted anywhere)
    UniqueFd fuse(open("/dev/fuse", O_RDWR | O_CLOEXEC));
    ASSERT_TRUE(fuse.valid());
    auto err = NextError();
    UniqueFd s = Connect(SockPath());
    ASSERT_TRUE(SendHandoffMessage(s.get(), EncodeHandoffReply(redeposit), fuse.get()).ok());
    auto m = ReceiveHandoffMessage(s.get());
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_FALSE(m->fd.valid());
    EXPECT_EQ(DecodeMountConfig(m->payload).status().code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_EQ(err.wait_for(kTestDeadline), std::future_status::ready);
  }
  lt_.RunOnLoop([&] {
    EXPECT_TRUE(endpoint_->awaiting_redeposit()) << "nothing was taken";
    EXPECT_FALSE(endpoint_->served());
    EXPECT_EQ(endpoint_->redeposits(), 0);
  });
}

// A server on an aborted connection may report its end after its successor took over the fresh
// one: that is no news about the current server.
TEST_F(HandoffEndpointTest, AnEarlierServersLateGoodbyeDoesNotUnseatTheCurrentOne) {
  StartEndpoint();
  UniqueFd first = Serve();
  ASSERT_EQ(served_cv_.get_future().wait_for(kTestDeadline), std::future_status::ready);
  // The kept connection ends (the write end of the stand-in closes: POLLHUP, as after an abort).
  pipe_w_.Reset();
  bool aborted = false;
  for (auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
       !aborted && std::chrono::steady_clock::now() < deadline;) {
    lt_.RunOnLoop([&] { aborted = endpoint_->aborted(); });
  }
  ASSERT_TRUE(aborted);
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd fresh_w(p[1]);
  lt_.RunOnLoop([&] { endpoint_->ReplaceConnection(UniqueFd(p[0])); });
  UniqueFd second = Serve();
  bool serving = false;
  for (auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
       !serving && std::chrono::steady_clock::now() < deadline;) {
    lt_.RunOnLoop([&] { serving = endpoint_->serving(); });
  }
  ASSERT_TRUE(serving);
  // Now the first server says goodbye, and closes. (Its receive is armed, so it completes as the
  // message arrives: before the endpoint accepts the next connection below.)
  ASSERT_TRUE(SendHandoffMessage(first.get(), EncodeHandoffReply({.ok = true}), -1).ok());
  first.Reset();
  UniqueFd third = Connect(SockPath());
  auto m = ReceiveHandoffMessage(third.get());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->fd.valid());
  EXPECT_NE(m->payload.find("already being served"), std::string::npos) << m->payload;
  lt_.RunOnLoop([&] {
    EXPECT_TRUE(endpoint_->serving());
    EXPECT_FALSE(endpoint_->server_gone());
    EXPECT_TRUE(gone_.empty()) << "the earlier server's end is no news: " << gone_[0];
  });
}


// Server pods (a listener each, in its emptyDir): while one pod's server serves, another pod's
// server waits on standby instead of being refused, and takes the live connection over the
// moment the serving one stops: a roll of the server pod costs no error.
class StandbyTest : public HandoffEndpointTest {
 protected:
  void AddPodListener(const std::string& tag) {
    lt_.RunOnLoop([&] {
      auto listen = HandoffEndpoint::ListenBlocking(dir_fd_.get(), tag, getuid(), getgid());
      ASSERT_TRUE(listen.ok()) << listen.status();
      endpoint_->AddListener(std::move(*listen), tag);
    });
  }
  // Waits (loop round trips, bounded) until the endpoint has `n` servers on standby.
  bool WaitStandby(size_t n) {
    for (int i = 0; i < 20000; ++i) {
      size_t now = 0;
      lt_.RunOnLoop([&] { now = endpoint_->standby(); });
      if (now == n) return true;
    }
    return false;
  }
  bool HasServerFrom(const std::string& tag) {
    bool has = false;
    lt_.RunOnLoop([&] { has = endpoint_->HasServerFrom(tag); });
    return has;
  }
  // An endpoint whose servers may drain 25 s, listeners pod-a and pod-b, and pod-a's server
  // serving; returns its connection and (in `config`) the config it was sent.
  UniqueFd ServeFromPodA(MountConfig* config) {
    HandoffOptions o;
    o.drain_wait = absl::Seconds(25);
    StartEndpoint(o);
    AddPodListener("pod-a");
    AddPodListener("pod-b");
    UniqueFd a = Connect(dir_.path() + "/pod-a");
    auto ma = ReceiveHandoffMessage(a.get());
    EXPECT_TRUE(ma.ok() && ma->fd.valid());
    if (!ma.ok()) return a;
    auto decoded = DecodeMountConfig(ma->payload);
    EXPECT_TRUE(decoded.ok());
    if (decoded.ok()) *config = *decoded;
    EXPECT_TRUE(SendHandoffMessage(a.get(), EncodeHandoffReply({.ok = true, .server = "a"}), -1).ok());
    EXPECT_EQ(served_cv_.get_future().wait_for(kTestDeadline), std::future_status::ready);
    return a;
  }
  // Whether the agent's next message on `server` (waited for, bounded) is a stop request.
  static bool ReceivesStopRequest(int server) {
    pollfd p{server, POLLIN, 0};
    if (poll(&p, 1, 20000) != 1) return false;
    char buf[256];
    const ssize_t n = recv(server, buf, sizeof(buf), 0);
    return n > 0 && IsStopRequest(absl::string_view(buf, static_cast<size_t>(n)));
  }
};

TEST_F(StandbyTest, ANewPodsServerWaitsOnStandbyAndTakesOverTheLiveConnection) {
  StartEndpoint();
  AddPodListener("pod-a");
  AddPodListener("pod-b");
  UniqueFd a = Connect(dir_.path() + "/pod-a");
  auto ma = ReceiveHandoffMessage(a.get());
  ASSERT_TRUE(ma.ok() && ma->fd.valid());
  ASSERT_TRUE(SendHandoffMessage(a.get(), EncodeHandoffReply({.ok = true, .server = "a"}), -1).ok());
  ASSERT_EQ(served_cv_.get_future().wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(HasServerFrom("pod-a"));
  EXPECT_FALSE(HasServerFrom("pod-b"));

  UniqueFd b = Connect(dir_.path() + "/pod-b");
  ASSERT_TRUE(WaitStandby(1));
  EXPECT_TRUE(HasServerFrom("pod-b"));
  pollfd p{b.get(), POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 0), 0) << "on standby: offered nothing yet";
  // A second connection on pod-a's own listener, while pod-a serves, is no standby: refused.
  UniqueFd a2 = Connect(dir_.path() + "/pod-a");
  auto ma2 = ReceiveHandoffMessage(a2.get());
  ASSERT_TRUE(ma2.ok());
  EXPECT_FALSE(ma2->fd.valid());

  // pod-a's server stops (its pod deleted): pod-b's is offered the live connection at once.
  auto gone = NextGone();
  a.Reset();
  ASSERT_EQ(gone.wait_for(kTestDeadline), std::future_status::ready);
  auto mb = ReceiveHandoffMessage(b.get());
  ASSERT_TRUE(mb.ok() && mb->fd.valid()) << mb.status();
  auto config = DecodeMountConfig(mb->payload);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->live) << "the same connection, adopted";
  ASSERT_TRUE(SendHandoffMessage(b.get(), EncodeHandoffReply({.ok = true, .server = "b"}), -1).ok());
  for (int i = 0; i < 20000 && !HasServerFrom("pod-b"); ++i) {
  }
  lt_.RunOnLoop([&] {
    EXPECT_TRUE(endpoint_->serving());
    EXPECT_EQ(endpoint_->adoptions(), 1);
    EXPECT_EQ(endpoint_->standby(), 0u);
  });
  EXPECT_TRUE(HasServerFrom("pod-b"));
}

// A server pod's server may drain (handoff_protocol.h): asked to stop, it says "draining" and
// serves on; the agent asks it to stop once a successor waits on standby, and the
// successor then takes the live connection over. The main socket's servers
// (sidecars: their pod goes as a whole) are not told to drain.
TEST_F(StandbyTest, ADrainingServerIsAskedToStopOnceASuccessorWaits) {
  MountConfig ca;
  UniqueFd a = ServeFromPodA(&ca);
  EXPECT_EQ(ca.drain_ms, 25000);
  // Draining, with no successor yet: nothing is asked, and it still serves.
  ASSERT_TRUE(SendHandoffMessage(a.get(), EncodeHandoffReply({.ok = true, .server = "a", .draining = true}), -1).ok());
  UniqueFd b = Connect(dir_.path() + "/pod-b");
  ASSERT_TRUE(WaitStandby(1));
  // The successor waits: the draining server is asked to stop.
  ASSERT_TRUE(ReceivesStopRequest(a.get()));
  lt_.RunOnLoop([&] {
    EXPECT_EQ(endpoint_->relieved(), 1);
    EXPECT_TRUE(endpoint_->serving()) << "a draining server still serves";
    EXPECT_TRUE(gone_.empty());
  });
  // It stops; the successor is offered the live connection, told it may drain in turn.
  a.Reset();
  auto mb = ReceiveHandoffMessage(b.get());
  ASSERT_TRUE(mb.ok() && mb->fd.valid()) << mb.status();
  auto cb = DecodeMountConfig(mb->payload);
  ASSERT_TRUE(cb.ok());
  EXPECT_TRUE(cb->live);
  EXPECT_EQ(cb->drain_ms, 25000);
  // A server on the main socket (a sidecar) is not.
  UniqueFd side = Connect(SockPath());
  auto ms = ReceiveHandoffMessage(side.get());
  ASSERT_TRUE(ms.ok());
  if (ms->fd.valid()) {
    auto cs = DecodeMountConfig(ms->payload);
    ASSERT_TRUE(cs.ok());
    EXPECT_EQ(cs->drain_ms, 0);
  }
}

// The other order: a successor already waits when the serving server starts draining (a roll
// deletes the old pod only then): it is asked to stop at once.
TEST_F(StandbyTest, ADrainingServerWithASuccessorWaitingIsAskedToStopAtOnce) {
  MountConfig ca;
  UniqueFd a = ServeFromPodA(&ca);
  UniqueFd b = Connect(dir_.path() + "/pod-b");
  ASSERT_TRUE(WaitStandby(1));
  pollfd p{a.get(), POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 0), 0) << "not draining: nothing is asked";
  ASSERT_TRUE(SendHandoffMessage(a.get(), EncodeHandoffReply({.ok = true, .server = "a", .draining = true}), -1).ok());
  EXPECT_TRUE(ReceivesStopRequest(a.get()));
}

TEST_F(StandbyTest, AStandbyThatHungUpIsSkippedAndARemovedListenerDropsItsStandby) {
  StartEndpoint();
  AddPodListener("pod-a");
  AddPodListener("pod-b");
  AddPodListener("pod-c");
  UniqueFd a = Serve();  // through the main socket
  ASSERT_EQ(served_cv_.get_future().wait_for(kTestDeadline), std::future_status::ready);
  UniqueFd sa = Connect(dir_.path() + "/pod-a");
  ASSERT_TRUE(WaitStandby(1));
  UniqueFd sb = Connect(dir_.path() + "/pod-b");
  ASSERT_TRUE(WaitStandby(2));
  UniqueFd sc = Connect(dir_.path() + "/pod-c");
  ASSERT_TRUE(WaitStandby(3));
  // pod-b is deleted: its listener goes, and its waiting server is let go (it sees the end).
  lt_.RunOnLoop([&] { endpoint_->RemoveListener("pod-b"); });
  ASSERT_TRUE(WaitStandby(2));
  char byte;
  EXPECT_EQ(recv(sb.get(), &byte, 1, 0), 0) << "dropped";
  // pod-a's waiting server dies; then the serving one stops: pod-c's takes over.
  sa.Reset();
  auto gone = NextGone();
  a.Reset();
  ASSERT_EQ(gone.wait_for(kTestDeadline), std::future_status::ready);
  auto mc = ReceiveHandoffMessage(sc.get());
  ASSERT_TRUE(mc.ok() && mc->fd.valid()) << mc.status();
  EXPECT_TRUE(DecodeMountConfig(mc->payload)->live);
}


// After an agent restart (no connection kept), a new server pod's server that has nothing to
// re-deposit waits on standby instead of asking for a fresh connection at once: the old pod's
// server may be about to re-deposit the live one. Only if none does within the bound does it get
// a fresh connection.
TEST_F(StandbyTest, AfterAnAgentRestartANewPodsServerWaitsForTheOldOnesReDepositBeforeAFreshConnection) {
  HandoffOptions o;
  o.redeposit_wait = absl::Milliseconds(20);
  o.standby_redeposit_wait = absl::Milliseconds(300);
  StartEndpoint(o, /*with_connection=*/false);
  AddPodListener("pod-new");
  UniqueFd s = Connect(dir_.path() + "/pod-new");
  ASSERT_TRUE(WaitStandby(1));
  int fresh = -1;
  lt_.RunOnLoop([&] { fresh = fresh_requested_; });
  EXPECT_EQ(fresh, 0) << "not yet: the serving server may re-deposit";
  // Nobody re-deposits: the standby is parked for a fresh connection (the owner makes one).
  for (int i = 0; i < 200000 && fresh == 0; ++i) lt_.RunOnLoop([&] { fresh = fresh_requested_; });
  EXPECT_EQ(fresh, 1);
  lt_.RunOnLoop([&] { EXPECT_EQ(endpoint_->standby(), 0u); });
  // A fresh connection goes to it.
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  close(p[1]);
  lt_.RunOnLoop([&] { endpoint_->ReplaceConnection(UniqueFd(p[0])); });
  auto m = ReceiveHandoffMessage(s.get());
  ASSERT_TRUE(m.ok() && m->fd.valid()) << m.status();
  EXPECT_FALSE(DecodeMountConfig(m->payload)->live);
}

}  // namespace
}  // namespace fusekeeper
