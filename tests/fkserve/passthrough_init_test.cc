#include "agent/fkserve/passthrough_init.h"

#include <linux/fuse.h>

#include <cstring>
#include <string>

#include "agent/fuse/passthrough_abi.h"
#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

template <typename T>
std::string Message(const T& body) {
  std::string msg(sizeof(fuse_out_header) + sizeof(T), '\0');
  fuse_out_header h{static_cast<uint32_t>(msg.size()), 0, 7};
  memcpy(msg.data(), &h, sizeof(h));
  memcpy(msg.data() + sizeof(h), &body, sizeof(body));
  return msg;
}

template <typename T>
T Body(const std::string& msg, size_t at = sizeof(fuse_out_header)) {
  T out;
  memcpy(&out, msg.data() + at, sizeof(out));
  return out;
}

TEST(PassthroughInitTest, AnInitRequestOffersFlagsInFlagsOrFlags2) {
  std::string init(sizeof(fuse_in_header) + sizeof(fuse_init_in), '\0');
  fuse_init_in in{};
  in.flags = FUSE_HANDLE_KILLPRIV_V2;
  memcpy(init.data() + sizeof(fuse_in_header), &in, sizeof(in));
  EXPECT_TRUE(InitOffers(init, FUSE_HANDLE_KILLPRIV_V2));
  EXPECT_FALSE(InitOffers(init, kInitFusePassthrough)) << "flags2 counts only with FUSE_INIT_EXT";
  in.flags2 = static_cast<uint32_t>(kInitFusePassthrough >> 32);
  memcpy(init.data() + sizeof(fuse_in_header), &in, sizeof(in));
  EXPECT_FALSE(InitOffers(init, kInitFusePassthrough));
  in.flags |= FUSE_INIT_EXT;
  memcpy(init.data() + sizeof(fuse_in_header), &in, sizeof(in));
  EXPECT_TRUE(InitOffers(init, kInitFusePassthrough));
  EXPECT_FALSE(InitOffers(init.substr(0, 20), FUSE_HANDLE_KILLPRIV_V2)) << "short";
}

TEST(PassthroughInitTest, TheInitReplyAsksForPassthroughAndKillPriv) {
  fuse_init_out out{};
  out.flags = FUSE_MAX_PAGES;
  std::string msg = Message(out);
  ASSERT_TRUE(OfferPassthroughInReply(&msg));
  ASSERT_TRUE(HandleKillPrivInReply(&msg));
  const auto got = Body<fuse_init_out>(msg);
  EXPECT_EQ(got.flags, FUSE_MAX_PAGES | FUSE_INIT_EXT | FUSE_HANDLE_KILLPRIV_V2);
  EXPECT_EQ(got.flags2, static_cast<uint32_t>(kInitFusePassthrough >> 32));
  uint32_t depth;
  memcpy(&depth, msg.data() + sizeof(fuse_out_header) + kInitOutMaxStackDepth, sizeof(depth));
  EXPECT_EQ(depth, kPassthroughStackDepth);
  // Writeback caching and passthrough do not go together; a short reply is left alone.
  out.flags = FUSE_WRITEBACK_CACHE;
  msg = Message(out);
  EXPECT_FALSE(OfferPassthroughInReply(&msg));
  std::string short_msg(sizeof(fuse_out_header) + 8, '\0');
  EXPECT_FALSE(OfferPassthroughInReply(&short_msg));
  EXPECT_FALSE(HandleKillPrivInReply(&short_msg));
  EXPECT_EQ(short_msg, std::string(sizeof(fuse_out_header) + 8, '\0'));
}

TEST(PassthroughInitTest, AnOpenOrCreateReplyOfThatHandleGetsTheBackingId) {
  fuse_open_out open{};
  open.fh = 0x100000005;
  std::string msg = Message(open);
  EXPECT_FALSE(PassThroughInOpenReply(&msg, 0x100000006, 9)) << "another handle";
  ASSERT_TRUE(PassThroughInOpenReply(&msg, 0x100000005, 9));
  auto got = Body<fuse_open_out>(msg);
  EXPECT_EQ(got.open_flags & kFopenPassthrough, kFopenPassthrough);
  int32_t id;
  memcpy(&id, msg.data() + sizeof(fuse_out_header) + kOpenOutBackingId, sizeof(id));
  EXPECT_EQ(id, 9);
  struct {
    fuse_entry_out entry;
    fuse_open_out open;
  } create{};
  create.open.fh = 0x100000007;
  msg = Message(create);
  ASSERT_TRUE(PassThroughInOpenReply(&msg, 0x100000007, 11));
  got = Body<fuse_open_out>(msg, sizeof(fuse_out_header) + sizeof(fuse_entry_out));
  EXPECT_EQ(got.open_flags & kFopenPassthrough, kFopenPassthrough);
  fuse_attr_out attr{};
  msg = Message(attr);
  EXPECT_FALSE(PassThroughInOpenReply(&msg, 0, 11)) << "not an OPEN or CREATE reply";
}

}  // namespace
}  // namespace fusekeeper
