#include "agent/csi/redact.h"

#include "gtest/gtest.h"
#include "proto/csi.pb.h"

namespace fusekeeper {
namespace {

TEST(RedactTest, SecretsAndMountFlagsNeverAppearButKeysAndOtherFieldsDo) {
  csi::v1::NodeStageVolumeRequest req;
  req.set_volume_id("vol-1");
  req.set_staging_target_path("/var/lib/kubelet/plugins/x/globalmount");
  (*req.mutable_secrets())["password"] = "hunter2";
  (*req.mutable_secrets())["token"] = "tok-SECRET";
  (*req.mutable_volume_context())["bucket"] = "public-bucket";
  req.mutable_volume_capability()->mutable_mount()->add_mount_flags("key=FLAGSECRET");
  std::string s = RedactedDebugString(req);
  EXPECT_EQ(s.find("hunter2"), std::string::npos) << s;
  EXPECT_EQ(s.find("tok-SECRET"), std::string::npos) << s;
  EXPECT_EQ(s.find("FLAGSECRET"), std::string::npos) << s;
  EXPECT_NE(s.find("password"), std::string::npos) << s;
  EXPECT_NE(s.find("vol-1"), std::string::npos) << s;
  EXPECT_NE(s.find("public-bucket"), std::string::npos) << s;
  // The original is untouched.
  EXPECT_EQ(req.secrets().at("password"), "hunter2");
}

TEST(RedactTest, EverySecretFieldInTheProtoIsCovered) {
  // Walks every message in csi.proto: each field marked csi_secret is redacted when set.
  const auto* file = csi::v1::NodeStageVolumeRequest::descriptor()->file();
  int secret_fields = 0;
  for (int i = 0; i < file->message_type_count(); ++i) {
    const auto* desc = file->message_type(i);
    for (int f = 0; f < desc->field_count(); ++f) {
      const auto* field = desc->field(f);
      if (!field->options().GetExtension(csi::v1::csi_secret)) continue;
      ++secret_fields;
      ASSERT_TRUE(field->is_map()) << field->full_name();
      std::unique_ptr<google::protobuf::Message> m(
          google::protobuf::MessageFactory::generated_factory()->GetPrototype(desc)->New());
      auto* entry = m->GetReflection()->AddMessage(m.get(), field);
      entry->GetReflection()->SetString(entry, entry->GetDescriptor()->map_key(), "k");
      entry->GetReflection()->SetString(entry, entry->GetDescriptor()->map_value(), "S3CR3T");
      EXPECT_EQ(RedactedDebugString(*m).find("S3CR3T"), std::string::npos) << field->full_name();
    }
  }
  EXPECT_EQ(secret_fields, 3);  // NodeStage, NodePublish, NodeExpand
}

TEST(RedactTest, TheOneLineSummaryNamesVolumePathsAndPodAndNothingElse) {
  csi::v1::NodePublishVolumeRequest pub;
  pub.set_volume_id("vol-1");
  pub.set_target_path("/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/v/mount");
  pub.set_staging_target_path("/var/lib/kubelet/plugins/x/globalmount");
  pub.mutable_volume_capability()->mutable_mount()->add_mount_flags("password=FLAG_SECRET");
  (*pub.mutable_secrets())["token"] = "SECRET_TOKEN";
  (*pub.mutable_volume_context())["bucket"] = "CONTEXT_VALUE";
  (*pub.mutable_volume_context())["csi.storage.k8s.io/pod.namespace"] = "team";
  (*pub.mutable_volume_context())["csi.storage.k8s.io/pod.name"] = "web-0";
  const std::string s = RpcSummary(pub);
  EXPECT_EQ(s,
            "volume_id=vol-1 target_path=/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/v/mount "
            "staging_target_path=/var/lib/kubelet/plugins/x/globalmount pod=team/web-0");
  for (const char* hidden : {"FLAG_SECRET", "SECRET_TOKEN", "CONTEXT_VALUE"}) {
    EXPECT_EQ(s.find(hidden), std::string::npos) << hidden;
  }
  csi::v1::NodeStageVolumeRequest stage;
  stage.set_volume_id("vol-2");
  stage.set_staging_target_path("/s");
  (*stage.mutable_secrets())["token"] = "SECRET_TOKEN";
  EXPECT_EQ(RpcSummary(stage), "volume_id=vol-2 staging_target_path=/s");
}

}  // namespace
}  // namespace fusekeeper
