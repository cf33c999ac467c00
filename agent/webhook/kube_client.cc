#include "agent/webhook/kube_client.h"

#include <cctype>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace fusekeeper::webhook {
namespace {

using json = nlohmann::json;

std::string Escape(const std::string& name) {
  // Object names are DNS subdomains; anything else cannot name an object and must not make a path.
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.')) return "";
  }
  return name;
}

}  // namespace

absl::StatusOr<bool> ClaimLookup::Look(const std::string& ns, const std::string& claim) const {
  const std::string n = Escape(ns), c = Escape(claim);
  if (n.empty() || c.empty()) return false;
  auto pvc = client_.Get(absl::StrCat("/api/v1/namespaces/", n, "/persistentvolumeclaims/", c));
  if (!pvc.ok()) return pvc.status();
  if (pvc->status == 404) return absl::NotFoundError("it does not exist (yet)");
  if (pvc->status != 200) return absl::UnavailableError(absl::StrCat("HTTP ", pvc->status));
  const json doc = json::parse(pvc->body, nullptr, false);
  if (!doc.is_object()) return absl::DataLossError("unreadable PersistentVolumeClaim");
  const json spec = doc.value("spec", json::object());
  if (const std::string pv = Escape(spec.value("volumeName", "")); !pv.empty()) {
    auto got = client_.Get(absl::StrCat("/api/v1/persistentvolumes/", pv));
    if (!got.ok()) return got.status();
    if (got->status != 200) return absl::UnavailableError(absl::StrCat("PersistentVolume ", pv, ": HTTP ", got->status));
    const json v = json::parse(got->body, nullptr, false);
    if (!v.is_object()) return absl::DataLossError("unreadable PersistentVolume");
    return v.value("spec", json::object()).value("csi", json::object()).value("driver", "") == driver_;
  }
  if (const std::string sc = Escape(spec.value("storageClassName", "")); !sc.empty()) {
    auto got = client_.Get(absl::StrCat("/apis/storage.k8s.io/v1/storageclasses/", sc));
    if (!got.ok()) return got.status();
    if (got->status == 404) return false;
    if (got->status != 200) return absl::UnavailableError(absl::StrCat("StorageClass ", sc, ": HTTP ", got->status));
    const json v = json::parse(got->body, nullptr, false);
    return v.is_object() && v.value("provisioner", "") == driver_;
  }
  return false;
}

ClaimInfo ClaimLookup::Resolve(const std::string& ns, const std::vector<std::string>& claims) {
  ClaimInfo info;
  const absl::Time now = absl::Now();
  for (const std::string& claim : claims) {
    const std::string key = absl::StrCat(ns, "/", claim);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(key);
      if (it != cache_.end() && now - it->second.second < ttl_) {
        info.ours[claim] = it->second.first;
        continue;
      }
    }
    auto ours = Look(ns, claim);
    if (!ours.ok()) {
      info.warnings.push_back(absl::StrCat("fusekeeper: could not tell whether claim ", claim, " is a ", driver_,
                                           " volume (", ours.status().message(),
                                           "); its mounts were left as the pod wrote them"));
      continue;
    }
    info.ours[claim] = *ours;
    std::lock_guard<std::mutex> lock(mu_);
    if (cache_.size() >= 4096) cache_.clear();  // bounded; answers are cheap to get again
    cache_[key] = {*ours, now};
  }
  return info;
}

absl::StatusOr<bool> HasNativeSidecars(const BlockingApiClient& client) {
  auto got = client.Get("/version");
  if (!got.ok()) return got.status();
  if (got->status != 200) return absl::UnavailableError(absl::StrCat("GET /version: HTTP ", got->status));
  const json v = json::parse(got->body, nullptr, false);
  if (!v.is_object()) return absl::DataLossError("GET /version: unreadable answer");
  int major = 0, minor = 0;
  // "minor" may carry a suffix on managed clusters ("29+").
  if (!absl::SimpleAtoi(v.value("major", ""), &major) ||
      !absl::SimpleAtoi(absl::StripSuffix(v.value("minor", ""), "+"), &minor)) {
    return absl::DataLossError(absl::StrCat("GET /version: cannot read version ", v.dump()));
  }
  return major > 1 || (major == 1 && minor >= 29);
}

}  // namespace fusekeeper::webhook
