// The API server's answers about server pods (PodList, Pod, PersistentVolumeList) and a volume's
// server declaration (volume_context) as untrusted input: nothing may crash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "agent/serverpod/api_objects.h"
#include "agent/serverpod/pod_manifest.h"
#include "agent/serverpod/server_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  (void)fusekeeper::ParseServerPodList(in);
  if (auto volumes = fusekeeper::ParseVolumeList(in, "fusekeeper.csi"); volumes.ok()) {
    for (const auto& v : *volumes) {
      auto percent = fusekeeper::ParseRolloutPercent(v.rollout, "rollout");
      if (percent.ok() && (*percent < 0 || *percent > 100)) __builtin_trap();
    }
  }
  (void)fusekeeper::ParseRolloutPercent(std::string(in), "rollout");
  (void)fusekeeper::ParsePodUid(in);
  (void)fusekeeper::ApiMessage(in);
  // The same bytes as a declaration: split at NULs into image, args, command, resources.
  google::protobuf::Map<std::string, std::string> ctx;
  const char* keys[] = {"serverImage", "serverArgs", "serverCommand", "serverResources"};
  size_t start = 0;
  for (const char* key : keys) {
    const size_t end = in.find('\0', start);
    ctx[key] = in.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  fusekeeper::state::ServerPod pod;
  if (fusekeeper::ParseServerPod(ctx, true, 1000, 1000, &pod).ok()) {
    fusekeeper::ServerPodSettings settings;
    settings.node = "node";
    (void)fusekeeper::BuildServerPod(settings, "volume", pod, 1000, 1000);
  }
  return 0;
}
