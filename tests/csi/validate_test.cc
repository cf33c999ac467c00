#include "agent/csi/validate.h"

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

using csi::v1::VolumeCapability;

VolumeCapability MountCap() {
  VolumeCapability cap;
  cap.mutable_mount();
  cap.mutable_access_mode()->set_mode(VolumeCapability::AccessMode::SINGLE_NODE_WRITER);
  return cap;
}

void ExpectInvalid(const absl::Status& s, const std::string& mentions) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(mentions), std::string::npos) << "'" << s.message() << "' lacks '" << mentions << "'";
}

TEST(ValidateTest, CapabilityChecks) {
  EXPECT_TRUE(ValidateVolumeCapability(MountCap(), "cap").ok());
  VolumeCapability none;
  none.mutable_access_mode()->set_mode(VolumeCapability::AccessMode::SINGLE_NODE_WRITER);
  ExpectInvalid(ValidateVolumeCapability(none, "cap"), "cap.access_type");
  VolumeCapability block = MountCap();
  block.mutable_block();
  ExpectInvalid(ValidateVolumeCapability(block, "cap"), "block volumes are not supported");
  VolumeCapability no_mode = MountCap();
  no_mode.clear_access_mode();
  ExpectInvalid(ValidateVolumeCapability(no_mode, "cap"), "cap.access_mode");
  VolumeCapability unknown = MountCap();
  unknown.mutable_access_mode()->set_mode(VolumeCapability::AccessMode::UNKNOWN);
  ExpectInvalid(ValidateVolumeCapability(unknown, "cap"), "not a known access mode");
  VolumeCapability bogus = MountCap();
  bogus.mutable_access_mode()->set_mode(static_cast<VolumeCapability::AccessMode::Mode>(42));
  ExpectInvalid(ValidateVolumeCapability(bogus, "cap"), "42");
  VolumeCapability big_flags = MountCap();
  for (int i = 0; i < 100; ++i) big_flags.mutable_mount()->add_mount_flags(std::string(50, 'x'));
  ExpectInvalid(ValidateVolumeCapability(big_flags, "cap"), "mount_flags");
  VolumeCapability nul_flag = MountCap();
  nul_flag.mutable_mount()->add_mount_flags(std::string("ro\0,rw", 6));
  ExpectInvalid(ValidateVolumeCapability(nul_flag, "cap"), "NUL");
}

TEST(ValidateTest, PublishRequiredFieldsInSpecOrder) {
  csi::v1::NodePublishVolumeRequest req;
  ExpectInvalid(ValidateNodePublish(req), "volume_id is required");
  req.set_volume_id("v");
  ExpectInvalid(ValidateNodePublish(req), "target_path is required");
  req.set_target_path("/t");
  ExpectInvalid(ValidateNodePublish(req), "volume_capability is required");
  *req.mutable_volume_capability() = MountCap();
  EXPECT_TRUE(ValidateNodePublish(req).ok());  // no staging path: an ephemeral volume
  req.set_target_path("relative/t");
  ExpectInvalid(ValidateNodePublish(req), "absolute");
}

TEST(ValidateTest, SizeLimitsAndNulBytes) {
  csi::v1::NodeStageVolumeRequest req;
  req.set_volume_id(std::string(129, 'v'));
  req.set_staging_target_path("/s");
  *req.mutable_volume_capability() = MountCap();
  ExpectInvalid(ValidateNodeStage(req), "129 bytes");
  req.set_volume_id(std::string(128, 'v'));
  EXPECT_TRUE(ValidateNodeStage(req).ok());
  req.set_volume_id(std::string("a\0b", 3));
  ExpectInvalid(ValidateNodeStage(req), "NUL");
  req.set_volume_id("v");
  req.set_staging_target_path(std::string("/s\0/../etc", 10));
  ExpectInvalid(ValidateNodeStage(req), "NUL");
  req.set_staging_target_path("/" + std::string(kMaxPathBytes, 'p'));
  ExpectInvalid(ValidateNodeStage(req), "staging_target_path");
  req.set_staging_target_path("/s");
  (*req.mutable_volume_context())["k"] = std::string(4096, 'x');
  ExpectInvalid(ValidateNodeStage(req), "volume_context");
  req.clear_volume_context();
  (*req.mutable_secrets())["k"] = std::string(4096, 'x');
  ExpectInvalid(ValidateNodeStage(req), "secrets");
}

TEST(ValidateTest, OtherRpcs) {
  csi::v1::NodeUnstageVolumeRequest unstage;
  ExpectInvalid(ValidateNodeUnstage(unstage), "volume_id");
  unstage.set_volume_id("v");
  ExpectInvalid(ValidateNodeUnstage(unstage), "staging_target_path");
  csi::v1::NodeUnpublishVolumeRequest unpub;
  ExpectInvalid(ValidateNodeUnpublish(unpub), "volume_id");
  unpub.set_volume_id("v");
  ExpectInvalid(ValidateNodeUnpublish(unpub), "target_path");
  csi::v1::NodeGetVolumeStatsRequest stats;
  ExpectInvalid(ValidateNodeGetVolumeStats(stats), "volume_id");
  stats.set_volume_id("v");
  ExpectInvalid(ValidateNodeGetVolumeStats(stats), "volume_path");
  stats.set_volume_path("/p");
  EXPECT_TRUE(ValidateNodeGetVolumeStats(stats).ok());
}

}  // namespace
}  // namespace fusekeeper
