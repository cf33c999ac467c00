// libFuzzer target: arbitrary bytes as Node RPC requests (what a hostile client could send):
// validation and log redaction never crash, and a secret value never shows up in the redacted
// text more often than it does when the secrets are blanked (a value may coincide with other
// text, e.g. "value: \"<re"; only extra occurrences would be a leak).
#include <cstddef>
#include <cstdint>
#include <string>

#include "agent/csi/redact.h"
#include "agent/csi/validate.h"
#include "proto/csi.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  csi::v1::NodePublishVolumeRequest pub;
  if (pub.ParseFromArray(data, static_cast<int>(size))) {
    (void)fusekeeper::ValidateNodePublish(pub);
    const std::string text = fusekeeper::RedactedDebugString(pub);
    csi::v1::NodePublishVolumeRequest blank = pub;
    for (auto& [k, v] : *blank.mutable_secrets()) v.clear();
    const std::string blank_text = fusekeeper::RedactedDebugString(blank);
    auto count = [](const std::string& hay, const std::string& needle) {
      size_t n = 0;
      for (size_t pos = hay.find(needle); pos != std::string::npos; pos = hay.find(needle, pos + 1)) ++n;
      return n;
    };
    for (const auto& [k, v] : pub.secrets()) {
      if (!v.empty() && count(text, v) > count(blank_text, v)) __builtin_trap();
    }
  }
  csi::v1::NodeStageVolumeRequest stage;
  if (stage.ParseFromArray(data, static_cast<int>(size))) {
    (void)fusekeeper::ValidateNodeStage(stage);
    (void)fusekeeper::RedactedDebugString(stage);
  }
  csi::v1::NodeGetVolumeStatsRequest stats;
  if (stats.ParseFromArray(data, static_cast<int>(size))) (void)fusekeeper::ValidateNodeGetVolumeStats(stats);
  return 0;
}
