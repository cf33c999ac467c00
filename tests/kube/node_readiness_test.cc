// The readiness taint's pure halves: whether the CSINode lists the driver, and the guarded patch
// that removes one taint and keeps the rest.
#include "agent/kube/node_readiness.h"

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace fusekeeper {
namespace {

using json = nlohmann::json;

TEST(NodeReadinessTest, TheCsiNodeListsTheDriverOrNot) {
  EXPECT_TRUE(*CsiNodeListsDriver(R"({"spec":{"drivers":[{"name":"a"},{"name":"fusekeeper.csi"}]}})", "fusekeeper.csi"));
  EXPECT_FALSE(*CsiNodeListsDriver(R"({"spec":{"drivers":[{"name":"a"}]}})", "fusekeeper.csi"));
  EXPECT_FALSE(*CsiNodeListsDriver(R"({"spec":{}})", "fusekeeper.csi")) << "no drivers yet";
  EXPECT_FALSE(*CsiNodeListsDriver(R"({"spec":{"drivers":[{"name":7},"x"]}})", "fusekeeper.csi")) << "odd shapes";
  EXPECT_FALSE(CsiNodeListsDriver("[1]", "fusekeeper.csi").ok());
  EXPECT_FALSE(CsiNodeListsDriver("{not json", "fusekeeper.csi").ok());
}

TEST(NodeReadinessTest, ThePatchRemovesOnlyOurTaintGuardedByTheResourceVersion) {
  const std::string node = R"({"metadata":{"resourceVersion":"7"},"spec":{"taints":[
      {"key":"a","effect":"NoSchedule"},{"key":"fusekeeper.csi/agent-not-ready","effect":"NoExecute"},
      {"key":"b","value":"v","effect":"NoExecute"}]}})";
  auto p = TaintRemovalPatch(node, kReadinessTaint);
  ASSERT_TRUE(p.ok()) << p.status();
  const json patch = json::parse(*p);
  ASSERT_EQ(patch.size(), 2u);
  EXPECT_EQ(patch[0], (json{{"op", "test"}, {"path", "/metadata/resourceVersion"}, {"value", "7"}}));
  EXPECT_EQ(patch[1]["op"], "replace");
  EXPECT_EQ(patch[1]["path"], "/spec/taints");
  EXPECT_EQ(patch[1]["value"], json::parse(R"([{"key":"a","effect":"NoSchedule"},{"key":"b","value":"v","effect":"NoExecute"}])"));
}

TEST(NodeReadinessTest, OurTaintAloneIsRemovedWholeAndAnUntaintedNodeNeedsNoPatch) {
  auto only = TaintRemovalPatch(
      R"({"metadata":{"resourceVersion":"9"},"spec":{"taints":[{"key":"fusekeeper.csi/agent-not-ready"}]}})",
      kReadinessTaint);
  ASSERT_TRUE(only.ok());
  EXPECT_EQ(json::parse(*only)[1], (json{{"op", "remove"}, {"path", "/spec/taints"}}));
  auto none = TaintRemovalPatch(R"({"metadata":{"resourceVersion":"9"},"spec":{"taints":[{"key":"a"}]}})",
                                kReadinessTaint);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  auto bare = TaintRemovalPatch(R"({"metadata":{"resourceVersion":"9"},"spec":{}})", kReadinessTaint);
  ASSERT_TRUE(bare.ok());
  EXPECT_TRUE(bare->empty());
  EXPECT_FALSE(TaintRemovalPatch(R"({"spec":{"taints":[{"key":"fusekeeper.csi/agent-not-ready"}]}})", kReadinessTaint)
                   .ok())
      << "no resourceVersion: no unguarded write";
  EXPECT_FALSE(TaintRemovalPatch("garbage", kReadinessTaint).ok());
}

}  // namespace
}  // namespace fusekeeper
