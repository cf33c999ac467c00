#include "agent/csi/redact.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/csi.pb.h"

namespace fusekeeper {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr char kRedacted[] = "<redacted>";

bool IsSensitive(const FieldDescriptor* f) {
  return f->options().GetExtension(csi::v1::csi_secret) ||
         f == csi::v1::VolumeCapability::MountVolume::descriptor()->FindFieldByName("mount_flags");
}

void RedactAllStrings(Message* m, const FieldDescriptor* f) {
  const Reflection* r = m->GetReflection();
  if (f->is_map()) {
    for (int i = 0; i < r->FieldSize(*m, f); ++i) {
      Message* entry = r->MutableRepeatedMessage(m, f, i);
      const FieldDescriptor* value = entry->GetDescriptor()->map_value();
      if (value->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
        entry->GetReflection()->SetString(entry, value, kRedacted);
      }
    }
  } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
    if (f->is_repeated()) {
      for (int i = 0; i < r->FieldSize(*m, f); ++i) r->SetRepeatedString(m, f, i, kRedacted);
    } else {
      r->SetString(m, f, kRedacted);
    }
  } else {
    r->ClearField(m, f);  // a sensitive non-string field: drop it entirely
  }
}

void Redact(Message* m) {
  const Reflection* r = m->GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(*m, &fields);
  for (const FieldDescriptor* f : fields) {
    if (IsSensitive(f)) {
      RedactAllStrings(m, f);
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && !f->is_map()) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(*m, f); ++i) Redact(r->MutableRepeatedMessage(m, f, i));
      } else {
        Redact(r->MutableMessage(m, f));
      }
    }
  }
}

}  // namespace

std::string RedactedDebugString(const Message& message) {
  std::unique_ptr<Message> copy(message.New());
  copy->CopyFrom(message);
  Redact(copy.get());
  return copy->ShortDebugString();
}

std::string RpcSummary(const csi::v1::NodeStageVolumeRequest& r) {
  return absl::StrCat("volume_id=", r.volume_id(), " staging_target_path=", r.staging_target_path());
}

std::string RpcSummary(const csi::v1::NodeUnstageVolumeRequest& r) {
  return absl::StrCat("volume_id=", r.volume_id(), " staging_target_path=", r.staging_target_path());
}

std::string RpcSummary(const csi::v1::NodePublishVolumeRequest& r) {
  std::string out = absl::StrCat("volume_id=", r.volume_id(), " target_path=", r.target_path());
  if (!r.staging_target_path().empty()) absl::StrAppend(&out, " staging_target_path=", r.staging_target_path());
  const auto& ctx = r.volume_context();
  auto ns = ctx.find("csi.storage.k8s.io/pod.namespace"), name = ctx.find("csi.storage.k8s.io/pod.name");
  if (ns != ctx.end() && name != ctx.end()) absl::StrAppend(&out, " pod=", ns->second, "/", name->second);
  if (r.readonly()) absl::StrAppend(&out, " readonly");
  return out;
}

std::string RpcSummary(const csi::v1::NodeUnpublishVolumeRequest& r) {
  return absl::StrCat("volume_id=", r.volume_id(), " target_path=", r.target_path());
}

std::string RpcSummary(const csi::v1::NodeGetVolumeStatsRequest& r) {
  return absl::StrCat("volume_id=", r.volume_id(), " volume_path=", r.volume_path());
}

std::string RpcSummary(const csi::v1::NodeExpandVolumeRequest& r) {
  return absl::StrCat("volume_id=", r.volume_id(), " volume_path=", r.volume_path());
}

}  // namespace fusekeeper
