// libFuzzer target: an AdmissionReview body of any shape must give an answer, never a crash. A
// 200 answer is a well-formed AdmissionReview response with at most 16 warnings of at most 256
// characters, and any patch it carries applies to the pod it came from.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/escaping.h"
#include "agent/webhook/admission.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using nlohmann::json;
  const std::string body(reinterpret_cast<const char*>(data), size);
  fusekeeper::webhook::Policy policy;
  // Every other claim is ours; lookups "fail" for names starting with 'x'.
  const fusekeeper::webhook::ClaimResolver resolve = [](const std::string&, const std::vector<std::string>& claims) {
    fusekeeper::webhook::ClaimInfo info;
    for (size_t i = 0; i < claims.size(); ++i) {
      if (!claims[i].empty() && claims[i][0] == 'x') {
        info.warnings.push_back("lookup failed");
      } else {
        info.ours[claims[i]] = i % 2 == 0;
      }
    }
    return info;
  };
  const fusekeeper::webhook::HttpAnswer a = fusekeeper::webhook::Review(body, policy, resolve);
  if (a.status != 200) return 0;
  const json out = json::parse(a.body, nullptr, false);
  if (!out.is_object() || !out.contains("response") || !out["response"].contains("uid")) __builtin_trap();
  const json& r = out["response"];
  if (r.contains("warnings")) {  // what the API server passes on uncut
    if (r["warnings"].size() > 16) __builtin_trap();
    for (const auto& w : r["warnings"]) {
      if (w.get<std::string>().size() > 256) __builtin_trap();
    }
  }
  if (r.contains("patch")) {
    std::string patch_text;
    if (!absl::Base64Unescape(r["patch"].get<std::string>(), &patch_text)) __builtin_trap();
    const json patch = json::parse(patch_text, nullptr, false);
    const json review = json::parse(body, nullptr, false);
    try {
      (void)review["request"]["object"].patch(patch);
    } catch (const std::exception&) {
      __builtin_trap();  // a patch that does not apply to its own pod
    }
  }
  return 0;
}
