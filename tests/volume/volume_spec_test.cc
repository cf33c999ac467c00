// Request fingerprints must stay what earlier agents saved: after an upgrade, kubelet repeating a
// NodeStageVolume or NodePublishVolume of a volume staged by the old agent must be a repeat, not a
// conflict (ALREADY_EXISTS would leave the pod stuck). The expected values were computed by the
// agent before volume kinds became modules (commit 5262607), from the same requests.
#include "agent/volume/volume_spec.h"

#include "agent/volume/fuse_kind.h"
#include "agent/volume/host_path_kind.h"
#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

using csi::v1::VolumeCapability;

// The spec the manager builds for a request: the kind's name, then the kind's fields.
state::Spec HostPathRequestSpec(const google::protobuf::Map<std::string, std::string>& ctx, const VolumeCapability& cap) {
  state::Spec spec;
  spec.set_kind(kHostPathKind);
  EXPECT_TRUE(ParseHostPathSpec(ctx, cap, &spec).ok());
  return spec;
}

state::Spec FuseRequestSpec(const google::protobuf::Map<std::string, std::string>& ctx, const VolumeCapability& cap) {
  state::Spec spec;
  spec.set_kind(kFuseKind);
  EXPECT_TRUE(ParseFuseSpec(ctx, cap, &spec).ok());
  return spec;
}

class FingerprintTest : public ::testing::Test {
 protected:
  void SetUp() override {
    host_path_["kind"] = "hostPath";
    host_path_["path"] = "/srv/data";
    host_path_["type"] = "Directory";
    fuse_["kind"] = "fuse";
    fuse_["serverUid"] = "1000";
    fuse_["bucket"] = "models";
    fuse_["socketVolume"] = "fk";
    ro_.mutable_mount()->add_mount_flags("ro");
    ro_.mutable_access_mode()->set_mode(VolumeCapability::AccessMode::MULTI_NODE_MULTI_WRITER);
    grouped_.mutable_mount()->add_mount_flags("noatime");
    grouped_.mutable_mount()->set_volume_mount_group("2000");
    grouped_.mutable_access_mode()->set_mode(VolumeCapability::AccessMode::SINGLE_NODE_WRITER);
  }
  google::protobuf::Map<std::string, std::string> host_path_, fuse_;
  VolumeCapability ro_, grouped_;
};

TEST_F(FingerprintTest, HostPathStageAndUnstagedPublishMatchEarlierAgents) {
  EXPECT_EQ(RequestFingerprint(HostPathRequestSpec(host_path_, ro_), ro_, false, ""),
            "2dd382478fe0b7debe3094e1497a8653182ea9b5414ff7037f30655477f1d1e9");
  EXPECT_EQ(RequestFingerprint(HostPathRequestSpec(host_path_, ro_), ro_, true, ""),
            "b544aa695526cb33e41ddf293245fd3f56db72af3495101a5d0268dabdaa222e");
}

TEST_F(FingerprintTest, FuseStageMatchesEarlierAgents) {
  EXPECT_EQ(RequestFingerprint(FuseRequestSpec(fuse_, grouped_), grouped_, false, ""),
            "bff8958fca05a6e6eb07678a049d4c265c15aaf531c1077bd8f82dcc76f7e6b0");
}

TEST_F(FingerprintTest, PublishesOfStagedVolumesMatchEarlierAgents) {
  state::Volume fuse;
  fuse.set_kind("fuse");
  fuse.mutable_fuse()->set_server_uid(1000);
  fuse.mutable_fuse()->set_server_gid(1000);
  fuse.mutable_fuse()->set_subtype("fusekeeper");
  fuse.mutable_fuse()->set_socket_path("/x.sock");  // not part of it
  fuse.mutable_fuse()->set_has_mount_group(true);
  fuse.mutable_fuse()->set_mount_group(2000);
  EXPECT_EQ(RequestFingerprint(StagedSpec(fuse, kFuseKind), grouped_, false, "/k/plugins/x/globalmount"),
            "1b88371b08baffc866e4fc19f13a67dec43f9509a4a85b1da6f557c069d7a069");
  // State saved before volumes recorded their kind is hostPath.
  state::Volume old;
  old.set_host_path("/srv/data");
  old.set_host_path_type("Directory");
  EXPECT_EQ(RequestFingerprint(StagedSpec(old, kHostPathKind), ro_, true, "/k/plugins/y/globalmount"),
            "3b4b24449fe5ca5860ea2cf22b656892bced10dac6d5f4b06860e46275aeab46");
}

TEST_F(FingerprintTest, EveryFieldCounts) {
  const std::string base = RequestFingerprint(HostPathRequestSpec(host_path_, ro_), ro_, false, "");
  host_path_["type"] = "DirectoryOrCreate";
  EXPECT_NE(RequestFingerprint(HostPathRequestSpec(host_path_, ro_), ro_, false, ""), base);
  fuse_["bucket"] = "other";
  EXPECT_NE(RequestFingerprint(FuseRequestSpec(fuse_, grouped_), grouped_, false, ""),
            "bff8958fca05a6e6eb07678a049d4c265c15aaf531c1077bd8f82dcc76f7e6b0")
      << "the server's volume_context is part of it";
}

}  // namespace
}  // namespace fusekeeper
