#include "agent/fkserve/backing_client.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "agent/base/unique_fd.h"
#include "agent/fuse/handoff_protocol.h"
#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

// The agent's end of the server's handoff connection, played by the test.
class BackingClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int pair[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
    agent_.Reset(pair[0]);
    client_.SetSocket(UniqueFd(pair[1]));
    file_.Reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
  }
  // The next request the client sent, and whether a file came with it.
  BackingRequest NextRequest(bool* with_fd = nullptr) {
    auto m = ReceiveHandoffMessage(agent_.get());
    EXPECT_TRUE(m.ok()) << m.status();
    if (with_fd != nullptr) *with_fd = m.ok() && m->fd.valid();
    auto r = DecodeBackingRequest(m.ok() ? m->payload : "");
    EXPECT_TRUE(r.ok() && r->has_value());
    return r.ok() && r->has_value() ? **r : BackingRequest{};
  }
  UniqueFd agent_, file_;
  BackingClient client_;
};

TEST_F(BackingClientTest, AnOpenGetsTheAgentsAnswer) {
  std::thread agent([&] {
    bool with_fd = false;
    const BackingRequest r = NextRequest(&with_fd);
    EXPECT_TRUE(r.open);
    EXPECT_TRUE(with_fd) << "the file goes with the request";
    client_.Deliver(BackingReply{r.id, 5, ""});
  });
  auto id = client_.Open(file_.get());
  agent.join();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, 5);
  EXPECT_EQ(client_.opened(), 1);
  client_.Close(5);
  const BackingRequest close = NextRequest();
  EXPECT_FALSE(close.open);
  EXPECT_EQ(close.backing_id, 5);
}

// An answer that comes after the open stopped waiting registered a file nobody will name: the
// client closes it.
TEST_F(BackingClientTest, ALateRegistrationIsClosed) {
  auto id = client_.Open(file_.get(), std::chrono::milliseconds(20));
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.status().message().find("did not answer in time"), std::string::npos) << id.status();
  const BackingRequest r = NextRequest();
  client_.Deliver(BackingReply{r.id, 9, ""});
  const BackingRequest close = NextRequest();
  EXPECT_FALSE(close.open);
  EXPECT_EQ(close.backing_id, 9);
  EXPECT_TRUE(client_.enabled()) << "a slow agent does not turn passthrough off";
}

// While the session waits for the agent, the volume waits: after one answer that did not come in
// time, opens are not asked about for a while (they are served the ordinary way at once).
TEST_F(BackingClientTest, AfterAnAnswerThatDidNotComeOpensDoNotAskForAWhile) {
  ASSERT_FALSE(client_.Open(file_.get(), std::chrono::milliseconds(20), std::chrono::hours(1)).ok());
  (void)NextRequest();
  auto next = client_.Open(file_.get());
  ASSERT_FALSE(next.ok());
  EXPECT_NE(next.status().message().find("not asking for a while"), std::string::npos) << next.status();
  char buf[256];
  EXPECT_EQ(recv(agent_.get(), buf, sizeof(buf), MSG_DONTWAIT), -1) << "nothing was sent";
  EXPECT_EQ(errno, EAGAIN);
  // A new connection to an agent is asked afresh.
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  agent_.Reset(pair[0]);
  client_.SetSocket(UniqueFd(pair[1]));
  std::thread agent([&] {
    const BackingRequest r = NextRequest();
    client_.Deliver(BackingReply{r.id, 3, ""});
  });
  auto id = client_.Open(file_.get());
  agent.join();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, 3);
}

TEST_F(BackingClientTest, ARefusalThatCannotChangeTurnsItOff) {
  std::thread agent([&] {
    const BackingRequest r = NextRequest();
    client_.Deliver(BackingReply{r.id, 0, "FUSE_DEV_IOC_BACKING_OPEN: EPERM (the connection did not negotiate passthrough)"});
  });
  EXPECT_FALSE(client_.Open(file_.get()).ok());
  agent.join();
  EXPECT_FALSE(client_.enabled());
  auto again = client_.Open(file_.get());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << "not asked again";
}

TEST_F(BackingClientTest, AnOpenWaitingWhenTheConnectionEndsFailsAtOnce) {
  std::thread agent([&] {
    (void)NextRequest();
    client_.SetSocket(UniqueFd());  // the agent went away
  });
  auto id = client_.Open(file_.get(), std::chrono::seconds(20));
  agent.join();
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.status().message().find("connection to the agent ended"), std::string::npos) << id.status();
  EXPECT_EQ(client_.Open(file_.get()).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace fusekeeper
