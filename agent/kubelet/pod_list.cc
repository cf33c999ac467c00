#include "agent/kubelet/pod_list.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "simdjson.h"

namespace fusekeeper {
namespace {

absl::Status Bad(absl::string_view what) { return absl::InvalidArgumentError(absl::StrCat("PodList: ", what)); }

std::string Str(simdjson::dom::element e, const char* key) {
  std::string_view v;
  if (e[key].get_string().get(v)) return "";
  return std::string(v);
}

absl::Status ReadContainers(simdjson::dom::element status, const char* key, bool init, PodStatus* pod) {
  simdjson::dom::element list;
  if (status[key].get(list)) return absl::OkStatus();  // absent
  simdjson::dom::array arr;
  if (list.get_array().get(arr)) return Bad(absl::StrCat(key, " is not an array"));
  for (simdjson::dom::element c : arr) {
    if (!c.is_object()) return Bad(absl::StrCat(key, " holds a non-object"));
    ContainerStatus cs;
    cs.init = init;
    cs.name = Str(c, "name");
    cs.container_id = Str(c, "containerID");
    int64_t n = 0;
    simdjson::dom::element rc;
    if (!c["restartCount"].get(rc)) {
      if (rc.get_int64().get(n)) return Bad("restartCount is not an integer");
    }
    cs.restart_count = n;
    simdjson::dom::element running;
    if (!c.at_pointer("/state/running").get(running)) cs.started_at = Str(running, "startedAt");
    if (cs.name.empty()) return Bad(absl::StrCat(key, " entry without a name"));
    pod->containers.push_back(std::move(cs));
  }
  return absl::OkStatus();
}

absl::Status ReadSpec(simdjson::dom::element spec, PodStatus* pod) {
  simdjson::dom::element list;
  if (!spec["volumes"].get(list) && !list.is_null()) {
    simdjson::dom::array arr;
    if (list.get_array().get(arr)) return Bad("spec.volumes is not an array");
    for (simdjson::dom::element v : arr) {
      if (!v.is_object()) return Bad("spec.volumes holds a non-object");
      PodVolume pv;
      pv.name = Str(v, "name");
      simdjson::dom::element sub;
      if (!v["csi"].get(sub) && sub.is_object()) pv.csi_driver = Str(sub, "driver");
      if (!v["persistentVolumeClaim"].get(sub) && sub.is_object()) pv.claim_name = Str(sub, "claimName");
      pod->volumes.push_back(std::move(pv));
    }
  }
  for (const char* key : {"containers", "initContainers"}) {
    if (spec[key].get(list) || list.is_null()) continue;
    simdjson::dom::array arr;
    if (list.get_array().get(arr)) return Bad(absl::StrCat("spec.", key, " is not an array"));
    for (simdjson::dom::element c : arr) {
      if (!c.is_object()) return Bad(absl::StrCat("spec.", key, " holds a non-object"));
      simdjson::dom::element mounts;
      if (c["volumeMounts"].get(mounts) || mounts.is_null()) continue;
      simdjson::dom::array marr;
      if (mounts.get_array().get(marr)) return Bad("volumeMounts is not an array");
      for (simdjson::dom::element m : marr) {
        if (!m.is_object()) return Bad("volumeMounts holds a non-object");
        pod->mounts.push_back({Str(c, "name"), Str(m, "name"), Str(m, "mountPropagation")});
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<PodStatus>> ParsePodList(absl::string_view json) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (auto err = parser.parse(json.data(), json.size()).get(doc); err) {
    return Bad(absl::StrCat("not JSON (", simdjson::error_message(err), ")"));
  }
  if (!doc.is_object()) return Bad("not an object");
  simdjson::dom::array items;
  simdjson::dom::element it;
  if (doc["items"].get(it)) return Bad("no \"items\"");
  if (it.is_null()) return std::vector<PodStatus>();
  if (it.get_array().get(items)) return Bad("\"items\" is not an array");
  std::vector<PodStatus> pods;
  for (simdjson::dom::element p : items) {
    simdjson::dom::element meta;
    if (!p.is_object() || p["metadata"].get(meta) || !meta.is_object()) return Bad("an item without metadata");
    PodStatus pod;
    pod.namespace_ = Str(meta, "namespace");
    pod.name = Str(meta, "name");
    pod.uid = Str(meta, "uid");
    if (pod.uid.empty()) return Bad("an item without metadata.uid");
    simdjson::dom::element deletion;
    pod.terminating = !meta["deletionTimestamp"].get(deletion) && !deletion.is_null();
    simdjson::dom::element spec;
    if (!p["spec"].get(spec) && spec.is_object()) {
      if (auto s = ReadSpec(spec, &pod); !s.ok()) return s;
    }
    simdjson::dom::element status;
    if (!p["status"].get(status) && status.is_object()) {
      if (auto s = ReadContainers(status, "containerStatuses", false, &pod); !s.ok()) return s;
      if (auto s = ReadContainers(status, "initContainerStatuses", true, &pod); !s.ok()) return s;
    }
    pods.push_back(std::move(pod));
  }
  return pods;
}

std::vector<ContainerRestart> RestartDetector::Update(const std::vector<PodStatus>& pods) {
  std::vector<ContainerRestart> out;
  std::set<std::string> present;
  for (const PodStatus& p : pods) {
    for (const ContainerStatus& c : p.containers) {
      const std::string key = absl::StrCat(p.uid, "/", c.init ? "init" : "app", "/", c.name);
      present.insert(key);
      Seen now{c.container_id, c.restart_count, c.started_at};
      auto it = seen_.find(key);
      if (it != seen_.end()) {
        const Seen& was = it->second;
        // The restart count is the kubelet's own signal; a new container id or start time with
        // the same count catches a restart the count has not caught up with yet.
        const bool same_count = c.restart_count == was.restart_count;
        const bool restarted =
            c.restart_count > was.restart_count ||
            (same_count && !c.container_id.empty() && !was.container_id.empty() && c.container_id != was.container_id) ||
            (same_count && !c.started_at.empty() && !was.started_at.empty() && c.started_at != was.started_at);
        if (restarted) out.push_back({p.namespace_, p.name, p.uid, c.name, c.restart_count});
      }
      seen_[key] = std::move(now);
    }
  }
  for (auto it = seen_.begin(); it != seen_.end();) {
    it = present.count(it->first) ? std::next(it) : seen_.erase(it);
  }
  return out;
}

}  // namespace fusekeeper
