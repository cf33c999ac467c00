#include "agent/fuse/handoff_protocol.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

TEST(HandoffProtocolTest, MountConfigRoundTripsHostileStrings) {
  MountConfig c;
  c.volume_id = "vol \"quoted\" \\ back\nslash \x01 ctrl \xc3\xbc";
  c.read_only = true;
  c.uid = 4294967295u;
  c.gid = 7;
  c.mount_group = 1000;
  c.mount_options = {"max_read=131072", "a,b"};
  c.volume_context = {{"bucket", "my-bucket"}, {"weird key\t", "v\"al"}};
  c.secrets = {{"token", "s3cret"}};
  auto d = DecodeMountConfig(EncodeMountConfig(c));
  ASSERT_TRUE(d.ok()) << d.status() << "\n" << EncodeMountConfig(c);
  EXPECT_EQ(d->volume_id, c.volume_id);
  EXPECT_TRUE(d->read_only);
  EXPECT_EQ(d->uid, c.uid);
  EXPECT_EQ(d->gid, 7u);
  ASSERT_TRUE(d->mount_group.has_value());
  EXPECT_EQ(*d->mount_group, 1000u);
  EXPECT_EQ(d->mount_options, c.mount_options);
  EXPECT_EQ(d->volume_context, c.volume_context);
  EXPECT_EQ(d->secrets, c.secrets);
}

TEST(HandoffProtocolTest, InvalidUtf8IsReplacedNotPassedThrough) {
  MountConfig c;
  c.volume_id = std::string("bad\xff\xfe");
  auto d = DecodeMountConfig(EncodeMountConfig(c));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->volume_id, "bad\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(HandoffProtocolTest, DecodeErrorsSayWhatIsWrong) {
  struct Case {
    std::string json, mentions;
  };
  std::vector<Case> cases = {
      {"not json", "not valid JSON"},
      {"[1,2]", "not a JSON object"},
      {R"({"volume_id":"v"})", "version"},
      {R"({"version":2,"volume_id":"v"})", "version 2 is not supported"},
      {R"({"version":1})", "volume_id"},
      {R"({"version":1,"volume_id":""})", "volume_id"},
      {R"({"version":1,"volume_id":"v","read_only":"yes"})", "read_only"},
      {R"({"version":1,"volume_id":"v","uid":-1})", "uid"},
      {R"({"version":1,"volume_id":"v","gid":4294967296})", "gid"},
      {R"({"version":1,"volume_id":"v","mount_group":"1000"})", "mount_group"},
      {R"({"version":1,"volume_id":"v","mount_options":"ro"})", "mount_options"},
      {R"({"version":1,"volume_id":"v","mount_options":[1]})", "mount_options"},
      {R"({"version":1,"volume_id":"v","volume_context":{"k":1}})", "volume_context"},
      {R"({"version":1,"volume_id":"v","secrets":[]})", "secrets"},
      {"{\"version\":1,\"volume_id\":\"" + std::string(kMaxHandoffMessageBytes, 'x') + "\"}", "allowed"},
  };
  for (const Case& c : cases) {
    auto d = DecodeMountConfig(c.json);
    ASSERT_FALSE(d.ok()) << c.json.substr(0, 80);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find(c.mentions), std::string::npos)
        << d.status() << " should mention " << c.mentions;
  }
  // Unknown fields are ignored: a newer agent may send more.
  EXPECT_TRUE(DecodeMountConfig(R"({"version":1,"volume_id":"v","future":{"x":[1]}})").ok());
}

TEST(HandoffProtocolTest, RandomBytesNeverCrashTheDecoder) {
  std::mt19937 rng(7);
  const std::string alphabet = "{}[]\":,0123456789truefalsnul\\ versionvolume_id\xff";
  for (int i = 0; i < 50000; ++i) {
    std::string s;
    int n = rng() % 100;
    for (int j = 0; j < n; ++j) s.push_back(alphabet[rng() % alphabet.size()]);
    (void)DecodeMountConfig(s);
    (void)DecodeHandoffReply(s);
  }
}

TEST(HandoffProtocolTest, RefusalIsReportedWithTheAgentsWords) {
  auto d = DecodeMountConfig(EncodeHandoffRefusal("volume v is already served"));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(d.status().message().find("volume v is already served"), std::string::npos);
}

TEST(HandoffProtocolTest, ReplyRoundTrip) {
  auto ok = DecodeHandoffReply(EncodeHandoffReply({.ok = true, .server = "fkserve 0.1"}));
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(ok->ok);
  EXPECT_EQ(ok->server, "fkserve 0.1");
  auto bad = DecodeHandoffReply(R"({"version":1,"ok":false})");
  ASSERT_TRUE(bad.ok());
  EXPECT_FALSE(bad->ok);
  EXPECT_FALSE(bad->error.empty());
  EXPECT_FALSE(DecodeHandoffReply(R"({"version":1})").ok());
}

TEST(HandoffProtocolTest, RelayedServersAndTheirRestartsRoundTrip) {
  HandoffReply r{.ok = true, .notice = "restarted"};
  r.relayed = true;
  r.restart_ms = 42;
  auto back = DecodeHandoffReply(EncodeHandoffReply(r));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->relayed);
  EXPECT_EQ(back->restart_ms, 42);
  auto plain = DecodeHandoffReply(EncodeHandoffReply({.ok = true}));
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->relayed);
  EXPECT_EQ(plain->restart_ms, -1) << "a notice that is not a restart";
  EXPECT_FALSE(DecodeHandoffReply(R"({"version":1,"ok":true,"restart_ms":-5})").ok());
  EXPECT_FALSE(DecodeHandoffReply(R"({"version":1,"ok":true,"relayed":"yes"})").ok());
}

TEST(HandoffProtocolTest, DrainingRoundTrips) {
  MountConfig c;
  c.volume_id = "v";
  c.drain_ms = 25000;
  auto back = DecodeMountConfig(EncodeMountConfig(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->drain_ms, 25000);
  c.drain_ms = 0;
  EXPECT_EQ(EncodeMountConfig(c).find("drain_ms"), std::string::npos) << "absent when off";
  EXPECT_FALSE(DecodeMountConfig(R"({"version":1,"volume_id":"v","drain_ms":-1})").ok());
  EXPECT_FALSE(DecodeMountConfig(R"({"version":1,"volume_id":"v","drain_ms":"soon"})").ok());
  auto r = DecodeHandoffReply(EncodeHandoffReply({.ok = true, .draining = true}));
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->draining);
  EXPECT_FALSE(DecodeHandoffReply(R"({"version":1,"ok":true,"draining":1})").ok());
  EXPECT_TRUE(IsStopRequest(EncodeStopRequest()));
  EXPECT_FALSE(IsStopRequest(R"({"version":1,"stop":false})"));
  EXPECT_FALSE(IsStopRequest(R"({"version":2,"stop":true})"));
  EXPECT_FALSE(IsStopRequest("{not json"));
  EXPECT_FALSE(IsStopRequest(EncodeHandoffRefusal("no")));
}

// A relay's state memfd travels with its ok reply (and re-deposits) and with a live config.
TEST(HandoffProtocolTest, RelayStateFlagsRoundTrip) {
  HandoffReply r{.ok = true};
  r.relayed = r.relay_state = true;
  auto back = DecodeHandoffReply(EncodeHandoffReply(r));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->relay_state);
  EXPECT_FALSE(DecodeHandoffReply(EncodeHandoffReply({.ok = true}))->relay_state);
  EXPECT_FALSE(DecodeHandoffReply(R"({"version":1,"ok":true,"relay_state":1})").ok());
  MountConfig c{.volume_id = "v", .live = true};
  c.relay_state = true;
  auto config = DecodeMountConfig(EncodeMountConfig(c));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->live);
  EXPECT_TRUE(config->relay_state);
  c.live = false;  // only a live connection has a state to carry on from
  EXPECT_FALSE(DecodeMountConfig(EncodeMountConfig(c))->relay_state);
}

class SocketPairTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    a_.Reset(sv[0]);
    b_.Reset(sv[1]);
  }
  UniqueFd a_, b_;
};

TEST_F(SocketPairTest, FdAndPayloadArriveTogetherCloseOnExec) {
  UniqueFd devnull(open("/dev/null", O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(SendHandoffMessage(a_.get(), "payload", devnull.get()).ok());
  auto m = ReceiveHandoffMessage(b_.get());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->payload, "payload");
  ASSERT_TRUE(m->fd.valid());
  struct stat s1, s2;
  ASSERT_EQ(fstat(devnull.get(), &s1), 0);
  ASSERT_EQ(fstat(m->fd.get(), &s2), 0);
  EXPECT_EQ(s1.st_rdev, s2.st_rdev);
  EXPECT_EQ(s1.st_ino, s2.st_ino);
  EXPECT_TRUE(fcntl(m->fd.get(), F_GETFD) & FD_CLOEXEC);
}

TEST_F(SocketPairTest, TwoFdsArriveInOrder) {
  UniqueFd first(open("/dev/null", O_RDONLY | O_CLOEXEC));
  UniqueFd second(memfd_create("state", MFD_CLOEXEC));
  ASSERT_TRUE(SendHandoffMessage(a_.get(), "{}", first.get(), second.get()).ok());
  auto m = ReceiveHandoffMessage(b_.get());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(IsMemfd(m->fd.get())) << "the first is the first sent";
  EXPECT_TRUE(IsMemfd(m->fd2.get()));
  EXPECT_EQ(fcntl(m->fd2.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
}

TEST_F(SocketPairTest, ThreeFdsAreRefusedAndAllClosed) {
  int extra[2];
  ASSERT_EQ(pipe2(extra, O_CLOEXEC), 0);
  // Hand-built message with three copies of the write end.
  char data[] = "x";
  iovec iov{data, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(3 * sizeof(int))];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(3 * sizeof(int));
  const int fds[3] = {extra[1], extra[1], extra[1]};
  memcpy(CMSG_DATA(cm), fds, sizeof(fds));
  ASSERT_EQ(sendmsg(a_.get(), &msg, 0), 1);
  close(extra[1]);  // our copy of the write end; the received copies must get closed too
  auto m = ReceiveHandoffMessage(b_.get());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  // If the receiver leaked a write end, this read would block instead of seeing EOF.
  char c;
  EXPECT_EQ(read(extra[0], &c, 1), 0) << "a received fd leaked";
  close(extra[0]);
}

TEST_F(SocketPairTest, PeerCloseIsUnavailable) {
  a_.Reset();
  EXPECT_EQ(ReceiveHandoffMessage(b_.get()).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace fusekeeper
