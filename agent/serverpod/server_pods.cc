#include "agent/serverpod/server_pods.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "agent/serverpod/server_spec.h"
#include "glog/logging.h"
#include "simdjson.h"

namespace fusekeeper {
namespace {

std::string PercentEncode(const std::string& s) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out += {'%', kHex[c >> 4], kHex[c & 15]};
    }
  }
  return out;
}

}  // namespace

ServerPods::ServerPods(Loop& loop, HttpClient& http, BlockingPool& pool, KubeApiConfig api,
                       ServerPodsOptions options, Events events)
    : loop_(loop),
      options_(std::move(options)),
      events_(std::move(events)),
      api_(http, pool, std::move(api), options_.request_timeout),
      resync_timer_(loop) {}

ServerPods::~ServerPods() = default;

void ServerPods::Send(std::string method, std::string path, std::string body,
                      absl::AnyInvocable<void(absl::StatusOr<HttpResult>)> done) {
  api_.Send(std::move(method), std::move(path), std::move(body), std::move(done));
}

std::vector<std::string> ServerPods::PodUids(const std::string& volume_id) const {
  std::vector<std::string> uids;
  auto it = wanted_.find(volume_id);
  if (it == wanted_.end()) return uids;
  for (const auto& [name, uid] : it->second.pods) uids.push_back(uid);
  return uids;
}

bool ServerPods::HasPod(const std::string& volume_id, const std::string& pod_uid) const {
  for (const auto& uid : PodUids(volume_id)) {
    if (uid == pod_uid) return true;
  }
  return false;
}

void ServerPods::Create(const std::string& volume_id, const state::ServerPod& spec, uint32_t uid, uint32_t gid,
                        absl::AnyInvocable<void(absl::Status)> done) {
  Want(volume_id, spec, uid, gid);
  const std::string name = wanted_[volume_id].manifest.name;
  Post(volume_id, wanted_[volume_id].manifest, [this, volume_id, name, done = std::move(done)](absl::Status s) mutable {
    if (!s.ok()) {
      auto it = wanted_.find(volume_id);
      if (it != wanted_.end() && it->second.manifest.name == name) wanted_.erase(it);
    }
    done(std::move(s));
  });
}

void ServerPods::Want(const std::string& volume_id, const state::ServerPod& spec, uint32_t uid, uint32_t gid) {
  Wanted& w = wanted_[volume_id];
  const bool fresh = w.volume_id.empty();
  w.volume_id = volume_id;
  w.uid = uid;
  w.gid = gid;
  if (!fresh && w.declared.SerializeAsString() == spec.SerializeAsString() && !w.manifest.name.empty()) return;
  // An image annotation seen before (what runs differs from what was declared) stays in force.
  const bool overridden = !fresh && !w.spec.image().empty() && w.spec.image() != w.declared.image();
  state::ServerPod effective = spec;
  if (overridden) effective.set_image(w.spec.image());
  w.declared = spec;
  SetSpec(w, effective);
}

void ServerPods::SetSpec(Wanted& w, const state::ServerPod& spec) {
  ServerPodManifest m = BuildServerPod(options_.settings, w.volume_id, spec, w.uid, w.gid);
  if (m.name == w.manifest.name) return;
  if (!w.manifest.name.empty()) {
    LOG(INFO) << "volume " << w.volume_id << ": its server pod changes from " << w.manifest.name << " to " << m.name
              << " (image " << spec.image() << "): rolling";
  }
  w.spec = spec;
  w.manifest = std::move(m);
  w.successor = BuildServerPod(options_.settings, w.volume_id, spec, w.uid, w.gid, /*successor=*/true);
  w.created_once = false;
  if (started_) ResyncSoon();
}

void ServerPods::ApplyOverrides(const std::vector<ListedVolume>& volumes) {
  std::map<std::string, const ListedVolume*> pv_of;
  for (const auto& v : volumes) pv_of[v.volume_handle] = &v;
  for (auto& [vid, w] : wanted_) {
    auto it = pv_of.find(vid);
    if (it == pv_of.end()) continue;  // no PV of ours by that handle (yet): as it is
    const ListedVolume& pv = *it->second;
    state::ServerPod effective = w.declared;
    std::string why;  // what made this node take the image
    if (!pv.server_image.empty()) {
      absl::Status s = CheckServerImage(pv.server_image, absl::StrCat("annotation ", kServerImageAnnotation));
      bool take = true;
      if (s.ok() && !pv.rollout.empty()) {
        auto percent = ParseRolloutPercent(pv.rollout, absl::StrCat("annotation ", kServerRolloutAnnotation));
        if (percent.ok()) {
          const int bucket = RolloutBucket(vid, options_.settings.node);
          take = bucket < *percent;
          why = absl::StrCat(", in batches: this node is ", take ? "among" : "not yet among", " the first ", *percent,
                             "% (", kServerRolloutAnnotation, ")");
        } else {
          s = percent.status();
        }
      }
      if (!s.ok()) {
        const std::string refused = absl::StrCat(pv.server_image, "\n", pv.rollout);
        if (events_.on_event && refused != w.refused_image) {
          events_.on_event(vid, "Warning", "ServerImageRefused",
                           absl::StrCat("volume ", vid, ": its PersistentVolume's ", s.message(), "; the server stays ",
                                        w.spec.image()));
        }
        w.refused_image = refused;
        continue;
      }
      if (take) effective.set_image(pv.server_image);
    }
    if (effective.image() != w.spec.image() && events_.on_event) {
      events_.on_event(vid, "Normal", "ServerPodRolling",
                       absl::StrCat("volume ", vid, ": its server rolls from ", w.spec.image(), " to ",
                                    effective.image(), " (PersistentVolume annotation ", kServerImageAnnotation,
                                    pv.server_image.empty() ? " removed" : "", why, ")"));
    }
    SetSpec(w, effective);
  }
}

void ServerPods::Post(const std::string& volume_id, const ServerPodManifest& m,
                      absl::AnyInvocable<void(absl::Status)> done) {
  const std::string name = m.name;
  creating_.insert(name);
  const std::string ns = options_.settings.namespace_;
  Send("POST", absl::StrCat("/api/v1/namespaces/", ns, "/pods"), m.json,
       [this, volume_id, name, ns, done = std::move(done)](absl::StatusOr<HttpResult> res) mutable {
         creating_.erase(name);
         auto it = wanted_.find(volume_id);
         if (it != wanted_.end() && Names(it->second, name)) {
           // Made (or found): missing from a later listing means deleted.
           if (res.ok() && (res->status == 201 || res->status == 200 || res->status == 409)) {
             it->second.created_once = true;
           }
         }
         const std::string what = absl::StrCat("server pod ", ns, "/", name, " of volume ", volume_id);
         if (!res.ok()) {
           ++stats_.api_errors;
           return done(absl::UnavailableError(
               absl::StrCat("the API server could not be reached to create ", what, ": ", res.status().message())));
         }
         auto take_uid = [this, volume_id, name](absl::string_view body) {
           auto uid = ParsePodUid(body);
           auto it = wanted_.find(volume_id);
           if (uid.ok() && it != wanted_.end()) Known(it->second, name, *uid);
         };
         if (res->status == 201 || res->status == 200) {
           ++stats_.created;
           LOG(INFO) << "created " << what;
           take_uid(res->body);
           return done(absl::OkStatus());
         }
         if (res->status == 409) {
           // Made before (an agent restart, a retried NodeStage): the same name is the same spec.
           LOG(INFO) << what << " exists already: taken as it is";
           Send("GET", absl::StrCat("/api/v1/namespaces/", ns, "/pods/", name), "",
                [take_uid](absl::StatusOr<HttpResult> got) mutable {
                  if (got.ok() && got->status == 200) take_uid(got->body);
                });
           return done(absl::OkStatus());
         }
         ++stats_.api_errors;
         const std::string api = ApiMessage(res->body);
         const std::string said = absl::StrCat("HTTP ", res->status, api.empty() ? "" : ": ", api);
         if (res->status == 401 || res->status == 403) {
           return done(absl::FailedPreconditionError(absl::StrCat(
               "the API server refused to create ", what, " (", said,
               "); the agent's service account needs pods create, get, list and delete in namespace ", ns)));
         }
         if (res->status == 400 || res->status == 422) {
           return done(absl::InvalidArgumentError(
               absl::StrCat("the API server rejected ", what, " as declared by the volume: ", said)));
         }
         if (res->status >= 500 || res->status == 429) {
           return done(absl::UnavailableError(absl::StrCat("the API server failed to create ", what, ": ", said)));
         }
         return done(absl::FailedPreconditionError(absl::StrCat("the API server refused to create ", what, ": ", said)));
       });
}

void ServerPods::Release(const std::string& volume_id) {
  auto it = wanted_.find(volume_id);
  std::set<std::string> names;
  if (it != wanted_.end()) {
    names.insert(it->second.manifest.name);
    names.insert(it->second.successor.name);
    while (!it->second.pods.empty()) {
      names.insert(it->second.pods.begin()->first);
      Gone(it->second, it->second.pods.begin()->first);
    }
    wanted_.erase(it);
  }
  const std::string label = VolumeLabelValue(volume_id);
  for (const auto& [name, p] : seen_) {
    if (p.volume_label == label) names.insert(name);
  }
  for (const auto& name : names) Delete(name, volume_id, "its volume was unstaged from this node");
  ResyncSoon();  // a delete that fails is tried again from the listing
}

void ServerPods::Delete(const std::string& name, const std::string& volume_id, const std::string& why) {
  if (!deleting_.insert(name).second) return;
  const std::string ns = options_.settings.namespace_;
  LOG(INFO) << "deleting server pod " << ns << "/" << name << " of volume " << volume_id << ": " << why;
  Send("DELETE", absl::StrCat("/api/v1/namespaces/", ns, "/pods/", name), "",
       [this, name, ns](absl::StatusOr<HttpResult> res) {
         deleting_.erase(name);
         if (res.ok() && (res->status == 200 || res->status == 202 || res->status == 404)) {
           if (res->status != 404) ++stats_.deleted;
           seen_.erase(name);
           return;
         }
         ++stats_.api_errors;
         LOG(WARNING) << "deleting server pod " << ns << "/" << name << " failed ("
                      << (res.ok() ? absl::StrCat("HTTP ", res->status) : std::string(res.status().message()))
                      << "); the next resync tries again";
       });
}

void ServerPods::Start() {
  if (started_) return;
  started_ = true;
  ScheduleResync(absl::ZeroDuration());
}

void ServerPods::ResyncSoon() {
  if (started_) ScheduleResync(absl::ZeroDuration());
}

void ServerPods::ScheduleResync(absl::Duration after) {
  resync_timer_.Arm(absl::ToChronoNanoseconds(after), [this] { Resync(); });
}

void ServerPods::Resync() {
  if (resyncing_) {
    resync_again_ = true;
    return;
  }
  resyncing_ = true;
  if (wanted_.empty()) return ListPods();
  // resourceVersion=0: from the API server's cache, not etcd.
  Send("GET", "/api/v1/persistentvolumes?resourceVersion=0", "", [this](absl::StatusOr<HttpResult> res) {
    if (res.ok() && res->status == 200) {
      auto volumes = ParseVolumeList(res->body, options_.driver_name);
      if (volumes.ok()) {
        ApplyOverrides(*volumes);
      } else {
        LOG(WARNING) << "the PersistentVolume list: " << volumes.status().message();
      }
    } else if (!pv_list_refused_) {
      pv_list_refused_ = true;
      LOG(WARNING) << "listing PersistentVolumes failed ("
                   << (res.ok() ? absl::StrCat("HTTP ", res->status) : std::string(res.status().message()))
                   << "): their " << kServerImageAnnotation
                   << " annotations are not read, so no server rolls (RBAC: persistentvolumes list)";
    }
    ListPods();
  });
}

void ServerPods::ListPods() {
  const uint64_t listed_at = ++lists_;
  Send("GET",
       absl::StrCat("/api/v1/namespaces/", options_.settings.namespace_,
                    "/pods?labelSelector=", PercentEncode(NodeSelector(options_.settings))),
       "", [this, listed_at](absl::StatusOr<HttpResult> res) {
         resyncing_ = false;
         absl::StatusOr<std::vector<ListedServerPod>> pods =
             !res.ok() ? absl::StatusOr<std::vector<ListedServerPod>>(res.status())
             : res->status != 200
                 ? absl::StatusOr<std::vector<ListedServerPod>>(absl::UnavailableError(absl::StrCat("HTTP ", res->status)))
                 : ParseServerPodList(res->body);
         if (!pods.ok()) {
           ++stats_.api_errors;
           LOG(WARNING) << "listing this node's server pods failed (" << pods.status().message()
                        << "); volumes keep being served, and the next resync tries again";
         } else {
           Reconcile(*pods, listed_at);
         }
         if (resync_again_) {
           resync_again_ = false;
           return ScheduleResync(absl::ZeroDuration());
         }
         // A node with no server pods and no volume that wants one asks the API server nothing
         // more until one does (Want, Create and Release resync): no load where they go unused.
         if (wanted_.empty() && pods.ok() && pods->empty()) return;
         ScheduleResync(options_.resync);
       });
}

void ServerPods::Known(Wanted& w, const std::string& name, const std::string& uid) {
  auto [it, added] = w.pods.emplace(name, uid);
  if (!added && it->second == uid) return;
  if (!added) {  // a pod of that name, made again: the old one is gone
    Gone(w, name);
    w.pods.emplace(name, uid);
  }
  known_at_[name] = lists_;  // after Gone, which forgets the old pod's
  if (events_.on_pod) events_.on_pod(w.volume_id, name, uid);
}

void ServerPods::Gone(Wanted& w, std::string name) {  // by value: callers pass keys of w.pods
  auto it = w.pods.find(name);
  if (it == w.pods.end()) return;
  const std::string uid = it->second;
  w.pods.erase(it);
  known_at_.erase(name);
  if (events_.on_pod_gone) events_.on_pod_gone(w.volume_id, name, uid);
}

void ServerPods::Reconcile(const std::vector<ListedServerPod>& pods, uint64_t listed_at) {
  std::map<std::string, const ListedServerPod*> by_name;
  for (const auto& p : pods) by_name[p.name] = &p;
  seen_.clear();
  for (const auto& p : pods) seen_[p.name] = p;
  auto say = [this](const std::string& vid, const std::string& type, const std::string& reason,
                    const std::string& message) {
    if (events_.on_event) events_.on_event(vid, type, reason, message);
  };
  // A pod learnt of after this list was asked for may be missing from it: no news.
  auto newer = [&](const std::string& name) {
    auto at = known_at_.find(name);
    return at != known_at_.end() && at->second >= listed_at;
  };
  auto ended = [](const ListedServerPod& p) { return p.phase == "Failed" || p.phase == "Succeeded"; };
  for (auto& [vid, w] : wanted_) {
    // Pods known before that are gone, or failed.
    for (auto known = w.pods.begin(); known != w.pods.end();) {
      const std::string name = known->first, uid = known->second;
      ++known;
      auto listed = by_name.find(name);
      if (listed == by_name.end() ? !newer(name) : (listed->second->uid != uid || ended(*listed->second))) {
        Gone(w, name);
      }
    }
    // Every pod of the volume whose server may still serve is known, not only the one it wants:
    // the one a roll replaces, and one still terminating (its server drains until its successor
    // waits), may be the one serving — after an agent restart its server re-deposits through it.
    const std::string label = VolumeLabelValue(vid);
    for (const auto& other : pods) {
      if (other.volume_label == label && !ended(other)) Known(w, other.name, other.uid);
    }
    // The wanted pod under either of its names: whichever lives serves. One that failed for good
    // (evicted) is deleted; one still terminating is waited out under the other name.
    const ListedServerPod* current = nullptr;
    const ServerPodManifest* free = nullptr;  // the first name no pod has
    bool in_flight = false;  // a POST not answered, or a pod made after this list was asked for
    for (const ServerPodManifest* m : {&w.manifest, &w.successor}) {
      in_flight |= creating_.count(m->name) > 0 || newer(m->name);
      auto listed = by_name.find(m->name);
      if (listed == by_name.end()) {
        if (free == nullptr) free = m;
        continue;
      }
      const ListedServerPod& p = *listed->second;
      w.created_once = true;
      if (!p.terminating && !ended(p)) {
        if (current == nullptr) current = &p;
      } else if (!p.terminating) {
        Delete(p.name, vid, absl::StrCat("it has stopped for good (phase ", p.phase, ")"));
        say(vid, "Warning", "ServerPodFailed",
            absl::StrCat("volume ", vid, ": server pod ", p.name, " ended (phase ", p.phase,
                         ", e.g. evicted); it is deleted and made again"));
      }
    }
    if (current == nullptr) {
      if (in_flight || free == nullptr) continue;  // both names still going: the next resync
      const bool again = w.created_once;
      w.created_once = true;
      if (again) ++stats_.recreated;
      Post(vid, *free, [this, vid, again, say](absl::Status s) {
        if (!s.ok()) {
          LOG(WARNING) << s.message();
          say(vid, "Warning", "ServerPodNotCreated", std::string(s.message()));
        } else if (again) {
          say(vid, "Normal", "ServerPodRecreated",
              absl::StrCat("volume ", vid, ": its server pod on this node was gone or going and has been created again"));
        }
      });
      continue;
    }
    const ListedServerPod& p = *current;
    // A roll: the volume's other pods go once the new one's server waits to take over.
    const bool ready = events_.standby_ready ? events_.standby_ready(vid, p.uid) : p.phase == "Running";
    if (!ready) continue;
    for (const auto& other : pods) {
      if (other.volume_label != label || other.name == p.name || other.terminating) continue;
      ++stats_.rolled;
      Gone(w, other.name);
      Delete(other.name, vid, absl::StrCat("rolled to ", p.name));
      say(vid, "Normal", "ServerPodRolled",
          absl::StrCat("volume ", vid, ": server pod ", other.name, " replaced by ", p.name, " (image ",
                       w.spec.image(), ")"));
    }
  }
  if (!started_) return;
  std::set<std::string> wanted_labels;
  for (const auto& [vid, w] : wanted_) wanted_labels.insert(VolumeLabelValue(vid));
  for (const auto& p : pods) {
    if (p.terminating || wanted_labels.count(p.volume_label) > 0) continue;
    Delete(p.name, p.volume_id, "no volume staged on this node wants it");
  }
}

}  // namespace fusekeeper
