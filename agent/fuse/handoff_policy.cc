#include "agent/fuse/handoff_policy.h"

namespace fusekeeper {

HandoffPolicy::Route HandoffPolicy::RouteArrival(const std::string& tag,
                                                 const std::optional<std::string>& serving_tag) const {
  if (serving_ && !tag.empty() && (!serving_tag.has_value() || *serving_tag != tag)) return Route::kStandby;
  if (serving_) return Route::kRefuse;
  return Route::kAdmit;
}

HandoffPolicy::Admission HandoffPolicy::Admit() const {
  if (kept_ == Kept::kAwaitingRedeposit) return Admission::kAwaitRedeposit;
  if (kept_ == Kept::kAborted) return Admission::kPark;
  return Admission::kOffer;
}

void HandoffPolicy::Served() {
  if (stopped_) return;
  served_ = true;
  serving_ = true;
  server_gone_ = false;
}

void HandoffPolicy::ServerGone() {
  if (stopped_) return;
  serving_ = false;
  server_gone_ = true;
}

void HandoffPolicy::Aborted() {
  if (stopped_) return;
  kept_ = Kept::kAborted;
  serving_ = false;
}

void HandoffPolicy::Replaced() {
  if (stopped_) return;
  kept_ = Kept::kHeld;
  served_ = false;
  serving_ = false;
  server_gone_ = false;
}

void HandoffPolicy::Redeposited() {
  if (stopped_ || kept_ != Kept::kAwaitingRedeposit) return;
  kept_ = Kept::kHeld;
}

const char* RouteName(HandoffPolicy::Route r) {
  switch (r) {
    case HandoffPolicy::Route::kStandby:
      return "standby";
    case HandoffPolicy::Route::kRefuse:
      return "refuse";
    case HandoffPolicy::Route::kAdmit:
      return "admit";
  }
  return "?";
}

const char* AdmissionName(HandoffPolicy::Admission a) {
  switch (a) {
    case HandoffPolicy::Admission::kAwaitRedeposit:
      return "await-redeposit";
    case HandoffPolicy::Admission::kPark:
      return "park";
    case HandoffPolicy::Admission::kOffer:
      return "offer";
  }
  return "?";
}

}  // namespace fusekeeper
