// ParseFuseSpec: what a fuse volume's volume_context and capability may say, and what reaches
// the server.
#include "agent/volume/fuse_kind.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/volume/spec_inputs.h"

namespace fusekeeper {
namespace {

using csi::v1::VolumeCapability;

TEST(FuseSpecTest, ServerIdentityGroupKernelOptionsAndServerContext) {
  state::Spec spec;
  ASSERT_TRUE(ParseFuseSpec(Context({{"kind", "fuse"},
                                     {"serverUid", "1000"},
                                     {"subtype", "s3fs"},
                                     {"passSecrets", "true"},
                                     {"socketVolume", "fk"},
                                     {"socketName", "s.sock"},
                                     {"bucket", "models"},
                                     {"maxBackground", "64"},
                                     {"csi.storage.k8s.io/pod.uid", "u-1"}}),
                            Cap({"ro", "noatime", "max_read=131072", "cache=strict"}, "2000"), &spec)
                  .ok());
  const state::Fuse& f = spec.fuse();
  EXPECT_EQ(f.server_uid(), 1000u);
  EXPECT_EQ(f.server_gid(), 1000u) << "serverGid defaults to serverUid";
  EXPECT_EQ(f.subtype(), "s3fs");
  EXPECT_TRUE(f.pass_secrets());
  EXPECT_TRUE(f.has_mount_group());
  EXPECT_EQ(f.mount_group(), 2000u);
  EXPECT_TRUE(f.read_only());
  EXPECT_TRUE(f.noatime());
  EXPECT_EQ(f.max_read(), 131072u);
  EXPECT_EQ(f.max_background(), 64u) << "tuning is the agent's to apply";
  EXPECT_FALSE(f.has_read_ahead_kb());
  EXPECT_TRUE(f.socket_path().empty()) << "the socket is placed by stage/publish, not by the spec";
  // Everything the agent does not read itself goes to the server; its own keys do not.
  EXPECT_EQ(spec.volume_context().size(), 2u);
  EXPECT_EQ(spec.volume_context().at("bucket"), "models");
  EXPECT_EQ(spec.volume_context().count("socketVolume"), 0u);
  EXPECT_EQ(spec.volume_context().count("serverUid"), 0u);
  EXPECT_EQ(spec.volume_context().count("maxBackground"), 0u);
}

TEST(FuseSpecTest, DefaultsWithNothingButTheKind) {
  state::Spec spec;
  ASSERT_TRUE(ParseFuseSpec(Context({{"kind", "fuse"}}), Cap(), &spec).ok());
  EXPECT_EQ(spec.fuse().subtype(), "fusekeeper");
  EXPECT_EQ(spec.fuse().server_uid(), 0u);
  EXPECT_FALSE(spec.fuse().has_mount_group());
  EXPECT_FALSE(spec.fuse().read_only());
}

TEST(FuseSpecTest, BadInputIsRefusedNamingWhatIsWrong) {
  struct Case {
    google::protobuf::Map<std::string, std::string> ctx;
    VolumeCapability cap;
    const char* says;
  };
  const Case cases[] = {
      {Context({{"serverUid", "root"}}), Cap(), "serverUid"},
      {Context({{"serverUid", "99999999999"}}), Cap(), "serverUid"},
      {Context({{"serverGid", "-1"}}), Cap(), "serverGid"},
      {Context({{"subtype", "a,allow_other"}}), Cap(), "subtype"},
      {Context({{"subtype", "a/b"}}), Cap(), "subtype"},
      {Context({{"socketName", ".."}}), Cap(), "socketName"},
      {Context({{"socketName", "a/b"}}), Cap(), "socketName"},
      {Context({}), Cap({}, "staff"), "volume_mount_group"},
      {Context({}), Cap({"rw", "allow_other"}), "mount flag #2 sets 'allow_other'"},
      {Context({}), Cap({"fd=3"}), "mount flag #1 sets 'fd'"},
      {Context({}), Cap({"cache=strict,user_id=0"}), "contains ','"},
      {Context({}), Cap({"max_read=0"}), "max_read"},
      {Context({}), Cap({"max_read=lots"}), "max_read"},
      {Context({{"readAheadKb", "huge"}}), Cap(), "volume_context.readAheadKb"},
      {Context({{"congestionThreshold", "0"}}), Cap(), "volume_context.congestionThreshold"},
  };
  for (const auto& c : cases) {
    state::Spec spec;
    absl::Status s = ParseFuseSpec(c.ctx, c.cap, &spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.says;
    EXPECT_TRUE(absl::StrContains(s.message(), c.says)) << s.message() << " should mention " << c.says;
  }
}

TEST(FuseSpecTest, RejectedMountFlagsNeverQuoteTheirValue) {
  state::Spec spec;
  absl::Status s = ParseFuseSpec(Context({}), Cap({"source=s3://key:hunter2@bucket"}), &spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(absl::StrContains(s.message(), "hunter2")) << s.message();
}

}  // namespace
}  // namespace fusekeeper
