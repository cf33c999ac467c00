// The handoff's ring adapter on a real loop with real sockets: accepts until closed, a send with
// fds, receives with fds, deadlines and closes, the calls that never wait, and the abort watch.
// Every operation's work ends (the owner's PendingWork is back at zero) once its callback ran.
#include "agent/fuse/handoff_io.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/fd_limit_scope.h"
#include "tests/testing/log_capture.h"
#include "tests/testing/loop_thread.h"

namespace fusekeeper {
namespace {

class HandoffIoTest : public ::testing::Test {
 protected:
  void TearDown() override {
    lt_.RunOnLoop([&] {
      if (listener_) listener_->Close();
    });
    if (listener_) {
      ASSERT_TRUE(WaitOnLoop([&] { return listener_->ended(); }));
      lt_.RunOnLoop([&] { listener_.reset(); });
    }
    if (peer_) lt_.RunOnLoop([&] { peer_.reset(); });
    EXPECT_EQ(Pending(), 0);
    lt_.StopAndJoin();
  }
  int Pending() {
    int n = -1;
    lt_.RunOnLoop([&] { n = work_.count(); });
    return n;
  }
  // Looks at `holds` on the loop after each turn it takes, until it holds (bounded).
  template <typename F>
  bool WaitOnLoop(F holds) {
    const auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
    while (std::chrono::steady_clock::now() < deadline) {
      bool yes = false;
      lt_.RunOnLoop([&] { yes = holds(); });
      if (yes) return true;
    }
    return false;
  }
  // A connected SOCK_SEQPACKET pair: [0] for the adapter, [1] for the test.
  void MakePair(size_t max_message_bytes = 64) {
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    other_.Reset(sv[1]);
    lt_.RunOnLoop([&] { peer_ = std::make_unique<HandoffPeer>(lt_.loop(), work_, UniqueFd(sv[0]), max_message_bytes); });
  }
  std::future<HandoffPeer::Received> Receive(std::optional<absl::Duration> deadline) {
    auto got = std::make_shared<std::promise<HandoffPeer::Received>>();
    auto future = got->get_future();
    lt_.RunOnLoop([&] {
      peer_->Receive(deadline, [this, got](HandoffPeer::Received r) {
        // What `message` points at is the peer's buffer: copied before the callback returns.
        message_ = std::string(r.message);
        got->set_value(std::move(r));
      });
    });
    return future;
  }

  LoopThread lt_;
  PendingWork work_{lt_.loop()};
  std::unique_ptr<HandoffListener> listener_;
  std::unique_ptr<HandoffPeer> peer_;
  UniqueFd other_;
  std::string message_;
};

TEST_F(HandoffIoTest, AListenerAcceptsUntilClosedThenSaysItHasEnded) {
  std::filesystem::path dir = std::filesystem::path(std::getenv("TEST_TMPDIR")) / "listen";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "sock").string();
  UniqueFd l(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  ASSERT_EQ(bind(l.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(l.get(), 8), 0);
  std::vector<int> flags;
  std::promise<void> two;
  bool ended = false;
  lt_.RunOnLoop([&] {
    listener_ = std::make_unique<HandoffListener>(lt_.loop(), work_, std::move(l), "pod-a", "volume t",
                                                  [&](UniqueFd fd) {
                                                    flags.push_back(fcntl(fd.get(), F_GETFD));
                                                    if (flags.size() == 2) two.set_value();
                                                  });
    listener_->set_on_ended([&] { ended = true; });
    listener_->Start();
  });
  auto connect_one = [&] {
    UniqueFd c(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    EXPECT_EQ(connect(c.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << strerror(errno);
    return c;
  };
  UniqueFd c1 = connect_one(), c2 = connect_one();
  ASSERT_EQ(two.get_future().wait_for(kTestDeadline), std::future_status::ready);
  lt_.RunOnLoop([&] {
    for (int f : flags) EXPECT_TRUE(f & FD_CLOEXEC) << "an accepted connection without O_CLOEXEC";
    EXPECT_EQ(listener_->tag(), "pod-a");
    EXPECT_FALSE(listener_->ended());
    EXPECT_EQ(work_.count(), 1);  // the next accept
    listener_->Close();
    EXPECT_TRUE(listener_->closed());
  });
  ASSERT_TRUE(WaitOnLoop([&] { return listener_->ended(); }));
  lt_.RunOnLoop([&] {
    EXPECT_TRUE(ended) << "on_ended did not run";
    EXPECT_EQ(flags.size(), 2u) << "accepted after it was closed";
  });
  // (Whether a connect now fails is the kernel's: the cancelled accept's request may still hold
  // the socket for a moment after its completion.)
}

// A process out of fds (a node with many volumes under a runtime's soft limit) cannot accept:
// the connection stays queued, and accepting again at once failed at once again, a hot loop on
// the agent's one thread with a log line per turn. The listener waits before its next accept
// (50 ms doubling), says so once, and takes the connection once fds are free.
TEST_F(HandoffIoTest, AListenerOutOfFdsWaitsBeforeItsNextAcceptInsteadOfSpinning) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "under the sanitizers: their runtime needs free fds of its own";
#endif
  // Under /tmp: the test's own tmpdir path is too long for a socket's 108 bytes.
  char made[] = "/tmp/fk-emfile-XXXXXX";
  ASSERT_NE(mkdtemp(made), nullptr);
  struct Remove {
    std::string dir;
    ~Remove() { std::filesystem::remove_all(dir); }
  } remove{made};
  const std::string path = std::string(made) + "/sock";
  UniqueFd l(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  ASSERT_EQ(bind(l.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << strerror(errno);
  ASSERT_EQ(listen(l.get(), 8), 0);
  std::promise<void> accepted;
  lt_.RunOnLoop([&] {
    listener_ = std::make_unique<HandoffListener>(lt_.loop(), work_, std::move(l), "", "volume emfile",
                                                  [&](UniqueFd) { accepted.set_value(); });
  });
  UniqueFd c(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  ASSERT_EQ(connect(c.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << strerror(errno);
  LogCapture log;
  // No fd is free below the limit: an accept fails with EMFILE (the ring's takes its fd before it
  // waits, so it fails with or without a connection queued).
  FdLimitScope no_fds;
  ASSERT_TRUE(no_fds.ok());
  lt_.RunOnLoop([&] { listener_->Start(); });
  const bool said = log.WaitFor("accept failed (Too many open files); waiting 50 ms", kTestDeadline);
  // Until the pause has doubled to 400 ms: four failed accepts in all (50, 100, 200, 400 ms
  // between them); a listener that spun would fail thousands of times and never pause.
  int pauses = 0;
  const bool doubled = WaitOnLoop([&] {
    pauses = listener_->backoff().pauses();
    return listener_->backoff().delay() >= std::chrono::milliseconds(400);
  });
  no_fds.Restore();
  ASSERT_TRUE(said) << log.text();
  ASSERT_TRUE(doubled) << "the listener never backed off to 400 ms";
  EXPECT_EQ(pauses, 4) << "one accept per pause, no more";
  EXPECT_EQ(log.Count("accept failed"), 1) << "said once, not per attempt\n" << log.text();
  ASSERT_EQ(accepted.get_future().wait_for(kTestDeadline), std::future_status::ready) << "taken once fds are free";
  EXPECT_TRUE(log.WaitFor("accepting again", kTestDeadline)) << log.text();
}

TEST_F(HandoffIoTest, ASendCarriesItsFdsAndAReceiveTakesTheOnesThatCame) {
  MakePair();
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd r(p[0]), w(p[1]);
  std::promise<int32_t> sent;
  lt_.RunOnLoop([&] { peer_->Send("offer", {w.get(), -1}, [&](int32_t res) { sent.set_value(res); }); });
  auto f = sent.get_future();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(f.get(), 5);
  char buf[64];
  std::vector<UniqueFd> fds;
  int flags = 0;
  bool other = false;
  ASSERT_EQ(ReceiveWithFds(other_.get(), buf, sizeof(buf), &fds, &flags, &other), 5);
  EXPECT_EQ(std::string(buf, 5), "offer");
  ASSERT_EQ(fds.size(), 1u) << "the -1 is skipped, the pipe's end comes";
  struct stat a, b;
  ASSERT_EQ(fstat(fds[0].get(), &a), 0);
  ASSERT_EQ(fstat(w.get(), &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino);

  // And back: a reply with an fd.
  auto got = Receive(absl::Seconds(20));
  const int back[1] = {r.get()};
  ASSERT_EQ(SendWithFds(other_.get(), "reply", 5, back, 1), 5);
  ASSERT_EQ(got.wait_for(kTestDeadline), std::future_status::ready);
  HandoffPeer::Received g = got.get();
  EXPECT_EQ(g.res, 5);
  EXPECT_EQ(message_, "reply");
  ASSERT_EQ(g.fds.size(), 1u);
  EXPECT_TRUE(fcntl(g.fds[0].get(), F_GETFD) & FD_CLOEXEC);
  EXPECT_FALSE(g.other_control);
  EXPECT_FALSE(g.truncated);
  lt_.RunOnLoop([&] {
    ASSERT_TRUE(peer_->Credentials().ok());
    EXPECT_EQ(peer_->Credentials()->pid, getpid());
  });
}

TEST_F(HandoffIoTest, AReceiveEndsAtItsDeadlineAtTheCloseOrTruncated) {
  MakePair(/*max_message_bytes=*/8);
  auto late = Receive(absl::Milliseconds(50));  // nobody says anything
  ASSERT_EQ(late.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(late.get().res, -ECANCELED);

  auto big = Receive(std::nullopt);
  const std::string twelve = "twelve bytes";
  ASSERT_EQ(send(other_.get(), twelve.data(), twelve.size(), 0), 12);
  ASSERT_EQ(big.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(big.get().truncated) << "a message over the bound was taken whole";

  auto cancelled = Receive(std::nullopt);
  lt_.RunOnLoop([&] { peer_->Cancel(); });
  ASSERT_EQ(cancelled.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(cancelled.get().res, -ECANCELED);

  auto closed = Receive(std::nullopt);
  other_.Reset();
  ASSERT_EQ(closed.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_EQ(closed.get().res, 0);
  lt_.RunOnLoop([&] {
    EXPECT_TRUE(peer_->HungUp());
    EXPECT_FALSE(peer_->WaitsQuietly());
    peer_->Close();
    EXPECT_FALSE(peer_->open());
  });
}

TEST_F(HandoffIoTest, TheCallsThatNeverWait) {
  MakePair();
  lt_.RunOnLoop([&] {
    EXPECT_TRUE(peer_->WaitsQuietly());
    EXPECT_FALSE(peer_->HungUp());
    EXPECT_TRUE(peer_->SendNow("stop"));
  });
  char buf[16];
  ASSERT_EQ(recv(other_.get(), buf, sizeof(buf), 0), 4);
  EXPECT_EQ(std::string(buf, 4), "stop");
  // Said something: no longer quiet. Then gone, with two messages unread.
  ASSERT_EQ(send(other_.get(), "one", 3, 0), 3);
  ASSERT_EQ(send(other_.get(), "last", 4, 0), 4);
  lt_.RunOnLoop([&] { EXPECT_FALSE(peer_->WaitsQuietly()); });
  other_.Reset();
  lt_.RunOnLoop([&] {
    EXPECT_TRUE(peer_->HungUp());
    EXPECT_EQ(peer_->QueuedAfterReset(), (std::vector<std::string>{"one", "last"}));
    EXPECT_FALSE(peer_->SendNow("x")) << "sent to a closed peer";
  });
}

TEST_F(HandoffIoTest, AnAbortWatchReportsTheCurrentFdOnlyAndStopsQuietly) {
  int a[2], b[2];
  ASSERT_EQ(pipe2(a, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(b, O_CLOEXEC), 0);
  UniqueFd a_r(a[0]), a_w(a[1]), b_r(b[0]), b_w(b[1]);
  int aborted = 0;
  std::promise<void> reported;
  std::unique_ptr<AbortWatch> watch;
  lt_.RunOnLoop([&] {
    watch = std::make_unique<AbortWatch>(lt_.loop(), work_, [&] {
      if (++aborted == 1) reported.set_value();
    });
    watch->Watch(a_w.get());
    watch->Watch(b_w.get());  // replaces the first
    EXPECT_TRUE(watch->watching());
  });
  a_r.Reset();  // POLLERR on a_w: no longer watched, nothing is said
  b_r.Reset();  // POLLERR on b_w: the current one
  ASSERT_EQ(reported.get_future().wait_for(kTestDeadline), std::future_status::ready);
  lt_.RunOnLoop([&] {
    EXPECT_EQ(aborted, 1);
    EXPECT_FALSE(watch->watching());
  });
  // A stopped watch says nothing of its fd's error.
  int c[2];
  ASSERT_EQ(pipe2(c, O_CLOEXEC), 0);
  UniqueFd c_r(c[0]), c_w(c[1]);
  lt_.RunOnLoop([&] {
    watch->Watch(c_w.get());
    watch->Stop();
  });
  c_r.Reset();
  ASSERT_TRUE(WaitOnLoop([&] { return work_.count() == 0; }));
  lt_.RunOnLoop([&] {
    EXPECT_EQ(aborted, 1);
    watch.reset();
  });
}

}  // namespace
}  // namespace fusekeeper
