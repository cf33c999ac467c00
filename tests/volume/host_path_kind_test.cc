// ParseHostPathSpec: what a hostPath volume's volume_context and capability may say.
#include "agent/volume/host_path_kind.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/volume/spec_inputs.h"

namespace fusekeeper {
namespace {

using csi::v1::VolumeCapability;

TEST(HostPathSpecTest, PathAndTypeAreRecorded) {
  state::Spec spec;
  ASSERT_TRUE(ParseHostPathSpec(Context({{"kind", "hostPath"}, {"path", "/srv/data"}, {"type", "DirectoryOrCreate"}}),
                                Cap({"ro", "nosuid"}), &spec)
                  .ok());
  EXPECT_EQ(spec.host_path(), "/srv/data");
  EXPECT_EQ(spec.host_path_type(), "DirectoryOrCreate");
  EXPECT_FALSE(spec.has_fuse()) << "no other kind's fields";
  EXPECT_TRUE(spec.volume_context().empty());
}

TEST(HostPathSpecTest, BadInputIsRefusedNamingWhatIsWrong) {
  struct Case {
    google::protobuf::Map<std::string, std::string> ctx;
    VolumeCapability cap;
    const char* says;
  };
  const Case cases[] = {
      {Context({{"kind", "hostPath"}}), Cap(), "volume_context.path is required"},
      {Context({{"path", "relative/dir"}}), Cap(), "relative"},
      {Context({{"path", "/srv/../etc"}}), Cap(), ".."},
      {Context({{"path", "/srv"}, {"type", "Symlink"}}), Cap(), "Symlink"},
      {Context({{"path", "/srv"}}), Cap({"rw", "cache=none"}), "mount flag #2"},
      {Context({{"path", "/srv"}}), Cap({}, "staff"), "volume_mount_group"},
  };
  for (const auto& c : cases) {
    state::Spec spec;
    absl::Status s = ParseHostPathSpec(c.ctx, c.cap, &spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.says;
    EXPECT_TRUE(absl::StrContains(s.message(), c.says)) << s.message() << " should mention " << c.says;
  }
}

TEST(HostPathSpecTest, RejectedMountFlagsAreNamedByPositionNeverQuoted) {
  state::Spec spec;
  absl::Status s = ParseHostPathSpec(Context({{"path", "/srv"}}), Cap({"password=hunter2"}), &spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(absl::StrContains(s.message(), "hunter2")) << s.message();
}

}  // namespace
}  // namespace fusekeeper
