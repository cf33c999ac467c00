#include "agent/fuse/fuse_tuning.h"

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

absl::Status Parse(std::map<std::string, std::string> ctx, state::Fuse* f) {
  google::protobuf::Map<std::string, std::string> m(ctx.begin(), ctx.end());
  return ParseFuseTuning(m, f);
}

TEST(FuseTuningTest, ValuesWithinBoundsAreTakenAndAbsentOnesLeftToTheKernel) {
  state::Fuse f;
  ASSERT_TRUE(Parse({{"readAheadKb", "0"}, {"maxBackground", "65535"}}, &f).ok());
  EXPECT_TRUE(f.has_read_ahead_kb());
  EXPECT_EQ(f.read_ahead_kb(), 0u) << "read-ahead off is a choice";
  EXPECT_EQ(f.max_background(), 65535u);
  EXPECT_FALSE(f.has_congestion_threshold());
  EXPECT_TRUE(HasFuseTuning(f));
  EXPECT_EQ(DescribeFuseTuning(f), "readAheadKb=0 maxBackground=65535");
  state::Fuse none;
  ASSERT_TRUE(Parse({{"bucket", "x"}}, &none).ok());
  EXPECT_FALSE(HasFuseTuning(none));
  EXPECT_TRUE(IsFuseTuningKey("congestionThreshold"));
  EXPECT_FALSE(IsFuseTuningKey("bucket"));
}

TEST(FuseTuningTest, BadValuesAreRefusedNamingTheKeyAndItsBounds) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"readAheadKb", "1048577"}, {"readAheadKb", "-1"},     {"readAheadKb", ""},
      {"maxBackground", "0"},     {"maxBackground", "1e3"},  {"maxBackground", "65536"},
      {"congestionThreshold", " 5"}, {"congestionThreshold", "99999999999999999999"}};
  for (const auto& [key, value] : bad) {
    state::Fuse f;
    absl::Status s = Parse({{key, value}}, &f);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << key << "=" << value;
    EXPECT_NE(s.message().find("volume_context." + key), std::string::npos) << s;
    EXPECT_NE(s.message().find(" to "), std::string::npos) << "says the bounds: " << s;
  }
}

}  // namespace
}  // namespace fusekeeper
