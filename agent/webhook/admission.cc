#include "agent/webhook/admission.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace fusekeeper::webhook {
namespace {

using json = nlohmann::json;

constexpr char kApiVersion[] = "admission.k8s.io/v1";

HttpAnswer BadRequest(const std::string& why) {
  HttpAnswer a;
  a.status = 400;
  a.content_type = "text/plain";
  a.body = absl::StrCat("fusekeeper webhook: ", why, "\n");
  return a;
}

HttpAnswer Answer(const std::string& uid, const Mutation& m) {
  json response = {{"uid", uid}, {"allowed", !m.denied.has_value()}};
  if (m.denied) {
    response["status"] = json{{"code", 403}, {"message", *m.denied}};
  } else if (!m.patch.empty()) {
    response["patchType"] = "JSONPatch";
    response["patch"] = absl::Base64Escape(m.patch.dump());
  }
  if (!m.warnings.empty()) {
    // The API server may cut warnings over 256 characters (and drop some of many): each is kept
    // within that, and at most 16 are sent.
    std::vector<std::string> warnings;
    for (const std::string& w : m.warnings) {
      if (warnings.size() == 16) break;
      warnings.push_back(w.size() <= 256 ? w : w.substr(0, 253) + "...");
    }
    response["warnings"] = warnings;
  }
  HttpAnswer a;
  a.body = json{{"apiVersion", kApiVersion}, {"kind", "AdmissionReview"}, {"response", std::move(response)}}.dump();
  return a;
}

}  // namespace

HttpAnswer Review(std::string_view body, const Policy& policy, const ClaimResolver& resolve) {
  json review = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (review.is_discarded() || !review.is_object()) return BadRequest("the body is not a JSON object");
  const auto api = review.find("apiVersion");
  const auto kind = review.find("kind");
  if (api == review.end() || !api->is_string() || kind == review.end() || *kind != "AdmissionReview") {
    return BadRequest("not an AdmissionReview");
  }
  if (*api != kApiVersion) {
    return BadRequest(absl::StrCat("AdmissionReview version ", api->get<std::string>(), " is not supported; this webhook ",
                                   "speaks ", kApiVersion, " (admissionReviewVersions: [v1])"));
  }
  const auto request = review.find("request");
  if (request == review.end() || !request->is_object()) return BadRequest("the AdmissionReview has no request");
  const auto uid = request->find("uid");
  if (uid == request->end() || !uid->is_string() || uid->get<std::string>().empty()) {
    return BadRequest("the AdmissionReview's request has no uid");
  }
  try {
    const json& r = *request;
    const auto resource = r.find("resource");
    const bool pod = resource != r.end() && resource->is_object() && resource->value("resource", "") == "pods" &&
                     resource->value("group", "") == "" && r.value("subResource", "") == "";
    if (!pod || r.value("operation", "") != "CREATE") return Answer(*uid, Mutation{});
    const auto object = r.find("object");
    if (object == r.end() || !object->is_object()) {
      Mutation m;
      m.warnings.push_back("fusekeeper: the review carries no pod; left alone");
      return Answer(*uid, m);
    }
    ClaimInfo claims;
    const std::vector<std::string> names = ClaimsOf(*object);
    if (!names.empty() && resolve) claims = resolve(r.value("namespace", ""), names);
    return Answer(*uid, MutatePod(*object, policy, claims));
  } catch (const std::exception& e) {
    // A pod this webhook cannot read is not its business: left alone, and said so.
    Mutation m;
    m.warnings.push_back(absl::StrCat("fusekeeper: could not read the pod (", e.what(), "); left alone"));
    return Answer(*uid, m);
  }
}

}  // namespace fusekeeper::webhook
