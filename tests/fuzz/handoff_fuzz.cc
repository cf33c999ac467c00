// libFuzzer target: the handoff decoders never crash, and a config that decodes round-trips
// through the encoder unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "agent/base/json.h"
#include "agent/fuse/handoff_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  auto config = fusekeeper::DecodeMountConfig(input);
  if (config.ok()) {
    auto again = fusekeeper::DecodeMountConfig(fusekeeper::EncodeMountConfig(*config));
    if (!again.ok() || again->volume_id != config->volume_id ||
        again->mount_options != config->mount_options || again->volume_context != config->volume_context ||
        again->secrets != config->secrets || again->uid != config->uid || again->gid != config->gid ||
        again->mount_group != config->mount_group || again->read_only != config->read_only ||
        again->drain_ms != config->drain_ms) {
      __builtin_trap();
    }
  }
  auto reply = fusekeeper::DecodeHandoffReply(input);
  if (reply.ok()) {
    auto again = fusekeeper::DecodeHandoffReply(fusekeeper::EncodeHandoffReply(*reply));
    if (!again.ok() || again->draining != reply->draining || again->ok != reply->ok) __builtin_trap();
  }
  (void)fusekeeper::IsStopRequest(input);
  (void)fusekeeper::JsonQuote(input);
  return 0;
}
