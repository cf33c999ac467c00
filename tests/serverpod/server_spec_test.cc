// The server a staged volume declares: what is accepted, and the error each bad input gets.
#include "agent/serverpod/server_spec.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

using Ctx = google::protobuf::Map<std::string, std::string>;

absl::Status Parse(const Ctx& ctx, state::ServerPod* pod, bool has_uid = true, uint32_t uid = 1000, uint32_t gid = 1000) {
  return ParseServerPod(ctx, has_uid, uid, gid, pod);
}

void ExpectInvalid(const Ctx& ctx, const std::string& says, bool has_uid = true, uint32_t uid = 1000,
                   uint32_t gid = 1000) {
  state::ServerPod pod;
  absl::Status s = Parse(ctx, &pod, has_uid, uid, gid);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), says)) << s.message();
}

TEST(ServerSpecTest, AFullDeclarationIsRead) {
  Ctx ctx;
  ctx["serverImage"] = "registry.example:5000/team/fs:1.4.2";
  ctx["serverCommand"] = R"(["/fkserve"])";
  ctx["serverArgs"] = R"(["--socket={socket}", "launch", "--", "squashfuse_ll", "-f", "/img", "/dev/fd/{fd}"])";
  ctx["serverResources"] = R"({"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}})";
  state::ServerPod pod;
  ASSERT_TRUE(Parse(ctx, &pod).ok());
  EXPECT_EQ(pod.image(), "registry.example:5000/team/fs:1.4.2");
  ASSERT_EQ(pod.command_size(), 1);
  ASSERT_EQ(pod.args_size(), 7);
  EXPECT_EQ(pod.args(0), "--socket={socket}");
  EXPECT_EQ(pod.requests().at("cpu"), "50m");
  EXPECT_EQ(pod.limits().at("memory"), "256Mi");
}

TEST(ServerSpecTest, ADigestIsAsGoodAsATag) {
  Ctx ctx;
  ctx["serverImage"] = "team/fs@sha256:" + std::string(64, 'a');
  state::ServerPod pod;
  EXPECT_TRUE(Parse(ctx, &pod).ok());
}

TEST(ServerSpecTest, NoImageMeansNoServerPodAndItsOtherKeysAreRefused) {
  Ctx ctx;
  state::ServerPod pod;
  ASSERT_TRUE(Parse(ctx, &pod, false, 0, 0).ok());
  EXPECT_TRUE(pod.image().empty());
  EXPECT_FALSE(DeclaresServerPod(ctx));
  ctx["serverArgs"] = "[]";
  ExpectInvalid(ctx, "serverArgs is given without serverImage");
}

TEST(ServerSpecTest, AnImageWithoutATagIsRefused) {
  for (const char* image : {"team/fs", "registry.example:5000/team/fs", "fs:", "team/fs:latest"}) {
    Ctx ctx;
    ctx["serverImage"] = image;
    ExpectInvalid(ctx, std::string("'") + image + "'");
  }
  Ctx ctx;
  ctx["serverImage"] = "team/fs@sha256:abc";
  ExpectInvalid(ctx, "digest");
  ctx["serverImage"] = "team/fs:1 --privileged";
  ExpectInvalid(ctx, "space");
  ctx["serverImage"] = "";
  ExpectInvalid(ctx, "empty");
}

TEST(ServerSpecTest, TheServerMustRunAsANonRootUser) {
  Ctx ctx;
  ctx["serverImage"] = "team/fs:1";
  ExpectInvalid(ctx, "serverUid is required", /*has_uid=*/false, 0, 0);
  ExpectInvalid(ctx, "serverUid is 0", true, 0, 1000);
  ExpectInvalid(ctx, "serverGid is 0", true, 1000, 0);
}

TEST(ServerSpecTest, ArgsMustBeAJsonArrayOfStrings) {
  Ctx ctx;
  ctx["serverImage"] = "team/fs:1";
  ctx["serverArgs"] = "--socket={socket} serve";
  ExpectInvalid(ctx, "serverArgs is not valid JSON");
  ctx["serverArgs"] = R"({"a": 1})";
  ExpectInvalid(ctx, "serverArgs is not a JSON array");
  ctx["serverArgs"] = R"(["a", 2])";
  ExpectInvalid(ctx, "element #2 is not a string");
  ctx.erase("serverArgs");
  ctx["serverCommand"] = "\"/bin/sh\"";
  ExpectInvalid(ctx, "serverCommand is not a JSON array");
}

TEST(ServerSpecTest, ResourcesMustBeNonNegativeQuantities) {
  Ctx ctx;
  ctx["serverImage"] = "team/fs:1";
  ctx["serverResources"] = R"({"requests": {"cpu": "-1"}})";
  ExpectInvalid(ctx, "requests.cpu '-1' is negative");
  ctx["serverResources"] = R"({"limits": {"memory": "lots"}})";
  ExpectInvalid(ctx, "is not a quantity");
  ctx["serverResources"] = R"({"requests": {"cpu": 1}})";
  ExpectInvalid(ctx, "is not a string");
  ctx["serverResources"] = R"({"requests": {"nvidia.com/gpu": "1"}})";
  ExpectInvalid(ctx, "names 'nvidia.com/gpu'");
  ctx["serverResources"] = R"({"request": {}})";
  ExpectInvalid(ctx, "has 'request'");
  ctx["serverResources"] = "[]";
  ExpectInvalid(ctx, "is not a JSON object");
}

TEST(ServerSpecTest, QuantitiesAsKubernetesWritesThem) {
  for (const char* ok : {"1", "0.5", "50m", "64Mi", "1G", "2Gi", "+1", "1.5k"}) {
    EXPECT_TRUE(CheckQuantity(ok, "q").ok()) << ok;
  }
  for (const char* bad : {"", "-5m", "m", "1.2.3", "5 Mi", "5MB", "1e3x"}) {
    EXPECT_FALSE(CheckQuantity(bad, "q").ok()) << bad;
  }
}

TEST(ServerSpecTest, RolloutSharesArePercentsFromZeroToAHundred) {
  EXPECT_EQ(ParseRolloutPercent("25%", "a").value_or(-1), 25);
  EXPECT_EQ(ParseRolloutPercent("0", "a").value_or(-1), 0);
  EXPECT_EQ(ParseRolloutPercent("100%", "a").value_or(-1), 100);
  for (const char* bad : {"", "%", "101%", "-5%", "2.5%", "25 %", "1000", "half"}) {
    auto r = ParseRolloutPercent(bad, "annotation x");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(r.status().message(), "annotation x")) << r.status();
  }
}

// Nodes spread over the buckets, so a share of N% takes about N% of them; a volume's bucket of a
// node is the same every time (every agent decides alone) and differs between volumes.
TEST(ServerSpecTest, RolloutBucketsSpreadNodesAndDependOnTheVolume) {
  int under25 = 0, same_for_other_volume = 0;
  for (int i = 0; i < 2000; ++i) {
    const std::string node = "node-" + std::to_string(i);
    const int b = RolloutBucket("vol-1", node);
    ASSERT_GE(b, 0);
    ASSERT_LT(b, 100);
    EXPECT_EQ(b, RolloutBucket("vol-1", node));
    under25 += b < 25;
    same_for_other_volume += b == RolloutBucket("vol-2", node);
  }
  EXPECT_GT(under25, 400);
  EXPECT_LT(under25, 600);
  EXPECT_LT(same_for_other_volume, 100);
}

}  // namespace
}  // namespace fusekeeper
