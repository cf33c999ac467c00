// ChangeLog alone: order kept across handles, a durable change dropped only once everything
// before it is durable, bounds making a node incomplete until each handle that changed it syncs;
// and the durability table.
#include "agent/fkserve/relay/change_log.h"

#include "agent/fkserve/relay/durability.h"
#include "gtest/gtest.h"

namespace fusekeeper::relay {
namespace {

TEST(ChangeLogTest, ADurableChangeStaysBehindAnOlderOneThatIsNot) {
  ChangeLog log;
  EXPECT_TRUE(log.Add(5, 1, "w1"));
  EXPECT_TRUE(log.Add(5, 2, "w2"));
  EXPECT_TRUE(log.Add(5, 0, "truncate"));
  log.Synced(5, 2);  // w2 and the truncate by path: durable, but w1 before them is not
  ASSERT_NE(log.Find(5), nullptr);
  ASSERT_EQ(log.Find(5)->changes.size(), 3u);
  EXPECT_FALSE(log.Find(5)->changes[0].durable);
  EXPECT_TRUE(log.Find(5)->changes[1].durable);
  EXPECT_TRUE(log.Find(5)->changes[2].durable);
  EXPECT_EQ(log.bytes(), 2u + 2u + 8u);
  log.Synced(5, 1);
  EXPECT_EQ(log.Find(5), nullptr);
  EXPECT_EQ(log.bytes(), 0u);
  EXPECT_TRUE(log.empty());
}

TEST(ChangeLogTest, PastItsBoundANodeIsIncompleteUntilEveryHandleThatChangedItSyncs) {
  ChangeLog log(/*max_node_bytes=*/10, /*max_total_bytes=*/15);
  EXPECT_TRUE(log.Add(5, 1, "12345"));
  EXPECT_TRUE(log.Add(5, 2, "12345"));
  EXPECT_FALSE(log.Add(5, 1, "x"));  // 11 bytes for one node
  ASSERT_NE(log.Find(5), nullptr);
  EXPECT_TRUE(log.Find(5)->incomplete);
  EXPECT_TRUE(log.Find(5)->changes.empty());
  EXPECT_EQ(log.bytes(), 0u);
  EXPECT_FALSE(log.Add(5, 3, "y")) << "nothing is kept while incomplete";
  log.Synced(5, 1);
  log.Synced(5, 3);
  EXPECT_TRUE(log.Find(5)->incomplete) << "handle 2 has not synced";
  log.Synced(5, 2);
  EXPECT_EQ(log.Find(5), nullptr);
  // The total bound, across nodes.
  EXPECT_TRUE(log.Add(6, 1, "1234567890"));
  EXPECT_FALSE(log.Add(7, 1, "1234567"));
  EXPECT_TRUE(log.Find(7)->incomplete);
  EXPECT_EQ(log.bytes(), 10u);
  // A change that cannot be written again.
  log.AddUnrepeatable(6, 4);
  EXPECT_TRUE(log.Find(6)->incomplete);
  EXPECT_EQ(log.bytes(), 0u);
  log.Synced(6, 4);
  EXPECT_TRUE(log.Find(6)->incomplete) << "handle 1's change was dropped before it synced";
  log.Synced(6, 1);
  EXPECT_EQ(log.Find(6), nullptr);
}

TEST(DurabilityTest, KnownProgramsAndNames) {
  EXPECT_EQ(KnownDurability("/usr/bin/bindfs"), Durability::kAtReply);
  EXPECT_EQ(KnownDurability("gocryptfs"), Durability::kAtReply);
  EXPECT_EQ(KnownDurability("s3fs"), Durability::kAtSync);
  EXPECT_EQ(KnownDurability("sshfs"), Durability::kAtSync);
  EXPECT_EQ(KnownDurability("rclone"), Durability::kAtClose);
  EXPECT_EQ(KnownDurability("fuse-zip"), Durability::kAtUnmount);
  EXPECT_FALSE(KnownDurability("myfs").has_value());
  for (Durability d : {Durability::kAtReply, Durability::kAtSync, Durability::kAtClose, Durability::kAtUnmount}) {
    EXPECT_EQ(ParseDurability(DurabilityName(d)), d);
  }
  EXPECT_FALSE(ParseDurability("fsync").has_value());
}

}  // namespace
}  // namespace fusekeeper::relay
