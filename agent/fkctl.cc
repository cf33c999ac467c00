// fkctl: a CSI command-line client (in the spirit of csc) for any Identity or Node RPC.
//
//   fkctl --endpoint=unix:///csi/csi.sock Probe
//   fkctl NodePublishVolume --volume_id=v1 --target_path=/var/lib/kubelet/pods/.../mount \
//         --access_mode=SINGLE_NODE_WRITER --volume_context=kind=hostPath,path=/data
//   fkctl ServerPods [--node=<name>]     (in an agent's container: kubectl exec ds/fusekeeper -c agent --)
//
// ServerPods is no RPC: it lists the staged volumes' server pods of every node (or one) from the
// API server with the agent's service account, and which image runs on how many nodes.
//
// Prints the response as JSON on stdout. On an RPC error prints "<CODE>: <message>" on stderr and
// exits with the numeric gRPC status code (always non-zero); usage errors exit 64.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "agent/kube/api_config.h"
#include "agent/kube/blocking_api_client.h"
#include "agent/kube/event_recorder.h"
#include "agent/serverpod/api_objects.h"
#include "agent/serverpod/pod_manifest.h"
#include "agent/serverpod/pod_table.h"
#include "agent/version.h"
#include "gflags/gflags.h"
#include "google/protobuf/util/json_util.h"
#include "proto/csi.grpc.pb.h"

DEFINE_string(endpoint, "", "CSI endpoint, unix:///path/csi.sock (default: $CSI_ENDPOINT)");
DEFINE_int32(timeout_ms, 10000, "RPC deadline");
DEFINE_string(volume_id, "", "volume_id");
DEFINE_string(target_path, "", "target_path (NodePublish/NodeUnpublish)");
DEFINE_string(staging_target_path, "", "staging_target_path");
DEFINE_string(volume_path, "", "volume_path (NodeGetVolumeStats/NodeExpandVolume)");
DEFINE_bool(readonly, false, "readonly (NodePublish)");
DEFINE_bool(no_capability, false, "send no volume_capability (to test validation)");
DEFINE_bool(block, false, "use access_type block instead of mount");
DEFINE_string(fs_type, "", "volume_capability.mount.fs_type");
DEFINE_string(mount_flags, "", "comma-separated volume_capability.mount.mount_flags");
DEFINE_string(volume_mount_group, "", "volume_capability.mount.volume_mount_group (fsGroup)");
DEFINE_string(access_mode, "SINGLE_NODE_WRITER", "access mode name (or UNKNOWN)");
DEFINE_string(volume_context, "", "k=v,k2=v2 (escape a literal comma as \\,)");
DEFINE_string(publish_context, "", "k=v,k2=v2");
DEFINE_string(secrets, "", "k=v,k2=v2 (sent as secrets; never printed)");
DEFINE_int64(required_bytes, 0, "capacity_range.required_bytes (NodeExpandVolume)");
DEFINE_string(node, "", "ServerPods: only this node's (empty: every node's)");
DEFINE_string(server_namespace, std::getenv("POD_NAMESPACE") != nullptr ? std::getenv("POD_NAMESPACE") : "fusekeeper",
              "ServerPods: the agent's namespace, where its server pods are (default: $POD_NAMESPACE)");
DEFINE_string(kube_secrets_dir, "/var/run/secrets/kubernetes.io/serviceaccount",
              "ServerPods: the service account's token and ca.crt (the API server from KUBERNETES_SERVICE_HOST/PORT)");

namespace {

using google::protobuf::Map;
using google::protobuf::Message;

constexpr int kUsageError = 64;

// `fkctl ServerPods`: one GET of the managed-by selector, printed as a table.
int ListServerPods() {
  auto api = fusekeeper::InClusterConfig(FLAGS_kube_secrets_dir);
  if (!api.ok()) {
    std::cerr << "ServerPods needs the API server: " << api.status().message() << "\n";
    return static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION);
  }
  const fusekeeper::BlockingApiClient client({.base_url = api->base_url,
                                              .ca_file = api->ca_file,
                                              .token_file = api->token_file,
                                              .timeout = absl::Milliseconds(FLAGS_timeout_ms)});
  auto answer = client.Get("/api/v1/namespaces/" + FLAGS_server_namespace + "/pods?labelSelector=" +
                           fusekeeper::kManagedByLabel + "%3D" + fusekeeper::kManagedBy);
  const std::string where = "the server pods in namespace " + FLAGS_server_namespace + " (" + api->base_url + ")";
  if (!answer.ok()) {
    std::cerr << "listing " << where << ": " << answer.status().message() << "\n";
    return static_cast<int>(grpc::StatusCode::UNAVAILABLE);
  }
  const long status = answer->status;
  if (status != 200) {
    const std::string said = fusekeeper::ApiMessage(answer->body);
    std::cerr << "listing " << where << ": HTTP " << status << (said.empty() ? "" : ": " + said)
              << (status == 401 || status == 403 ? " (the service account needs pods list there)" : "") << "\n";
    return static_cast<int>(status == 401 || status == 403 ? grpc::StatusCode::PERMISSION_DENIED
                                                           : grpc::StatusCode::UNAVAILABLE);
  }
  auto pods = fusekeeper::ParseServerPodList(answer->body);
  if (!pods.ok()) {
    std::cerr << "listing " << where << ": " << pods.status().message() << "\n";
    return static_cast<int>(grpc::StatusCode::INTERNAL);
  }
  std::cout << fusekeeper::ServerPodTable(std::move(*pods), FLAGS_node);
  return 0;
}

// Splits on unescaped commas; "\," is a literal comma.
std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  std::string cur;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size() && s[i + 1] == ',') {
      cur += ',';
      ++i;
    } else if (s[i] == ',') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += s[i];
    }
  }
  out.push_back(cur);
  return out;
}

bool FillMap(const std::string& flag, const std::string& value, Map<std::string, std::string>* m) {
  for (const std::string& kv : SplitList(value)) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::cerr << "--" << flag << ": '" << kv << "' is not key=value\n";
      return false;
    }
    (*m)[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return true;
}

bool FillCapability(csi::v1::VolumeCapability* cap) {
  if (FLAGS_block) {
    cap->mutable_block();
  } else {
    auto* mount = cap->mutable_mount();
    mount->set_fs_type(FLAGS_fs_type);
    for (const std::string& f : SplitList(FLAGS_mount_flags)) mount->add_mount_flags(f);
    mount->set_volume_mount_group(FLAGS_volume_mount_group);
  }
  csi::v1::VolumeCapability::AccessMode::Mode mode;
  if (!csi::v1::VolumeCapability::AccessMode::Mode_Parse(FLAGS_access_mode, &mode)) {
    std::cerr << "--access_mode: unknown mode '" << FLAGS_access_mode << "'\n";
    return false;
  }
  cap->mutable_access_mode()->set_mode(mode);
  return true;
}

// Builds the request for `rpc`, calls it, and returns the process exit code.
template <typename Req, typename Resp, typename Stub>
int Call(Stub* stub,
         grpc::Status (Stub::*method)(grpc::ClientContext*, const Req&, Resp*),
         const std::function<bool(Req*)>& fill) {
  Req req;
  if (!fill(&req)) return kUsageError;
  Resp resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(FLAGS_timeout_ms));
  grpc::Status status = (stub->*method)(&ctx, req, &resp);
  if (!status.ok()) {
    static const char* kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
                                   "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                                   "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                   "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                   "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
    int code = status.error_code();
    std::cerr << (code >= 0 && code <= 16 ? kNames[code] : "CODE_" + std::to_string(code)) << ": "
              << status.error_message() << "\n";
    return code;
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.always_print_primitive_fields = true;
  google::protobuf::util::MessageToJsonString(resp, &json, opts);
  std::cout << json;
  return 0;
}

// The Identity RPC named `rpc` and its exit code; nullopt if `rpc` is no Identity RPC.
std::optional<int> CallIdentity(const std::string& rpc, const std::shared_ptr<grpc::Channel>& channel) {
  auto identity = csi::v1::Identity::NewStub(channel);
  using IStub = csi::v1::Identity::Stub;
  namespace v1 = csi::v1;

  if (rpc == "GetPluginInfo") {
    return Call<v1::GetPluginInfoRequest, v1::GetPluginInfoResponse>(
        identity.get(), &IStub::GetPluginInfo, [](auto*) { return true; });
  }
  if (rpc == "GetPluginCapabilities") {
    return Call<v1::GetPluginCapabilitiesRequest, v1::GetPluginCapabilitiesResponse>(
        identity.get(), &IStub::GetPluginCapabilities, [](auto*) { return true; });
  }
  if (rpc == "Probe") {
    return Call<v1::ProbeRequest, v1::ProbeResponse>(identity.get(), &IStub::Probe,
                                                     [](auto*) { return true; });
  }
  return std::nullopt;
}

// The Node RPC named `rpc` and its exit code; nullopt if `rpc` is no Node RPC.
std::optional<int> CallNode(const std::string& rpc, const std::shared_ptr<grpc::Channel>& channel) {
  auto node = csi::v1::Node::NewStub(channel);
  using NStub = csi::v1::Node::Stub;
  namespace v1 = csi::v1;

  if (rpc == "NodeGetInfo") {
    return Call<v1::NodeGetInfoRequest, v1::NodeGetInfoResponse>(
        node.get(), &NStub::NodeGetInfo, [](auto*) { return true; });
  }
  if (rpc == "NodeGetCapabilities") {
    return Call<v1::NodeGetCapabilitiesRequest, v1::NodeGetCapabilitiesResponse>(
        node.get(), &NStub::NodeGetCapabilities, [](auto*) { return true; });
  }
  if (rpc == "NodeStageVolume") {
    return Call<v1::NodeStageVolumeRequest, v1::NodeStageVolumeResponse>(
        node.get(), &NStub::NodeStageVolume, [](v1::NodeStageVolumeRequest* r) {
          r->set_volume_id(FLAGS_volume_id);
          r->set_staging_target_path(FLAGS_staging_target_path);
          if (!FLAGS_no_capability && !FillCapability(r->mutable_volume_capability())) return false;
          return FillMap("volume_context", FLAGS_volume_context, r->mutable_volume_context()) &&
                 FillMap("publish_context", FLAGS_publish_context, r->mutable_publish_context()) &&
                 FillMap("secrets", FLAGS_secrets, r->mutable_secrets());
        });
  }
  if (rpc == "NodeUnstageVolume") {
    return Call<v1::NodeUnstageVolumeRequest, v1::NodeUnstageVolumeResponse>(
        node.get(), &NStub::NodeUnstageVolume, [](v1::NodeUnstageVolumeRequest* r) {
          r->set_volume_id(FLAGS_volume_id);
          r->set_staging_target_path(FLAGS_staging_target_path);
          return true;
        });
  }
  if (rpc == "NodePublishVolume") {
    return Call<v1::NodePublishVolumeRequest, v1::NodePublishVolumeResponse>(
        node.get(), &NStub::NodePublishVolume, [](v1::NodePublishVolumeRequest* r) {
          r->set_volume_id(FLAGS_volume_id);
          r->set_target_path(FLAGS_target_path);
          r->set_staging_target_path(FLAGS_staging_target_path);
          r->set_readonly(FLAGS_readonly);
          if (!FLAGS_no_capability && !FillCapability(r->mutable_volume_capability())) return false;
          return FillMap("volume_context", FLAGS_volume_context, r->mutable_volume_context()) &&
                 FillMap("publish_context", FLAGS_publish_context, r->mutable_publish_context()) &&
                 FillMap("secrets", FLAGS_secrets, r->mutable_secrets());
        });
  }
  if (rpc == "NodeUnpublishVolume") {
    return Call<v1::NodeUnpublishVolumeRequest, v1::NodeUnpublishVolumeResponse>(
        node.get(), &NStub::NodeUnpublishVolume, [](v1::NodeUnpublishVolumeRequest* r) {
          r->set_volume_id(FLAGS_volume_id);
          r->set_target_path(FLAGS_target_path);
          return true;
        });
  }
  if (rpc == "NodeGetVolumeStats") {
    return Call<v1::NodeGetVolumeStatsRequest, v1::NodeGetVolumeStatsResponse>(
        node.get(), &NStub::NodeGetVolumeStats, [](v1::NodeGetVolumeStatsRequest* r) {
          r->set_volume_id(FLAGS_volume_id);
          r->set_volume_path(FLAGS_volume_path);
          r->set_staging_target_path(FLAGS_staging_target_path);
          return true;
        });
  }
  if (rpc == "NodeExpandVolume") {
    return Call<v1::NodeExpandVolumeRequest, v1::NodeExpandVolumeResponse>(
        node.get(), &NStub::NodeExpandVolume, [](v1::NodeExpandVolumeRequest* r) {
          r->set_volume_id(FLAGS_volume_id);
          r->set_volume_path(FLAGS_volume_path);
          r->set_staging_target_path(FLAGS_staging_target_path);
          if (FLAGS_required_bytes > 0) r->mutable_capacity_range()->set_required_bytes(FLAGS_required_bytes);
          if (!FLAGS_no_capability && !FillCapability(r->mutable_volume_capability())) return false;
          return FillMap("secrets", FLAGS_secrets, r->mutable_secrets());
        });
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetVersionString(fusekeeper::kVersion);
  gflags::SetUsageMessage(
      "fkctl [flags] <RPC>\nRPCs: GetPluginInfo GetPluginCapabilities Probe NodeGetInfo "
      "NodeGetCapabilities NodeStageVolume NodeUnstageVolume NodePublishVolume "
      "NodeUnpublishVolume NodeGetVolumeStats NodeExpandVolume\n"
      "and ServerPods (the server pods of every node, from the API server)");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  if (argc != 2) {
    std::cerr << gflags::ProgramUsage() << "\n";
    return kUsageError;
  }
  const std::string rpc = argv[1];
  if (rpc == "ServerPods") return ListServerPods();
  std::string endpoint = FLAGS_endpoint;
  if (endpoint.empty() && std::getenv("CSI_ENDPOINT") != nullptr) endpoint = std::getenv("CSI_ENDPOINT");
  if (endpoint.empty()) endpoint = "unix:///csi/csi.sock";
  // gRPC's target syntax for a unix socket path is unix:/path or unix:///path.
  if (endpoint.rfind("unix:", 0) != 0) endpoint = "unix:" + endpoint;
  auto channel = grpc::CreateChannel(endpoint, grpc::InsecureChannelCredentials());
  if (auto code = CallIdentity(rpc, channel)) return *code;
  if (auto code = CallNode(rpc, channel)) return *code;
  std::cerr << "unknown RPC '" << rpc << "'\n" << gflags::ProgramUsage() << "\n";
  return kUsageError;
}
