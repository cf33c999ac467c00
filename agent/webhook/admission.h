// One AdmissionReview (admission.k8s.io/v1) in, one out: parsing and validating the review,
// handing the pod to MutatePod, and encoding the answer (JSON Patch, base64, warnings, or a
// denial). Pure apart from `resolve`; any thread.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "agent/webhook/pod_mutation.h"

namespace fusekeeper::webhook {

struct HttpAnswer {
  int status = 200;  // 400 for a request that is not a usable AdmissionReview
  std::string content_type = "application/json";
  std::string body;
};

// Looks up which of a pod's claims (in `ns`) are fusekeeper volumes.
using ClaimResolver = std::function<ClaimInfo(const std::string& ns, const std::vector<std::string>& claims)>;

// Answers the AdmissionReview in `body`. Never throws: malformed JSON, another API version, a
// review without a request or uid is a 400 naming what is wrong; a review of anything but a pod
// CREATE is allowed unchanged.
HttpAnswer Review(std::string_view body, const Policy& policy, const ClaimResolver& resolve);

}  // namespace fusekeeper::webhook
