#include "agent/webhook/pod_mutation.h"

#include <cstdint>
#include <regex>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/kube/server_container.h"

namespace fusekeeper::webhook {
namespace {

using json = nlohmann::json;

constexpr char kDefaultSocketName[] = "fusekeeper.sock";
constexpr char kReadyFile[] = "/fusekeeper/ready";

// obj[key] if obj is an object holding key, else null.
const json* Member(const json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

std::string String(const json& obj, const char* key) {
  const json* v = Member(obj, key);
  return v != nullptr && v->is_string() ? v->get<std::string>() : "";
}

const json& ArrayOrEmpty(const json& obj, const char* key) {
  static const json kEmpty = json::array();
  const json* v = Member(obj, key);
  return v != nullptr && v->is_array() ? *v : kEmpty;
}

// A name of at most 63 characters: `prefix + volume`, or, when that is too long, shortened with a
// hash of the volume name so that different volumes keep different names.
std::string BoundedName(const std::string& prefix, const std::string& volume) {
  std::string name = prefix + volume;
  if (name.size() <= 63) return name;
  uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char c : volume) h = (h ^ c) * 16777619u;
  char hex[9];
  snprintf(hex, sizeof(hex), "%08x", h);
  return prefix + volume.substr(0, 63 - prefix.size() - 9) + "-" + hex;
}

bool ValidQuantity(const std::string& q) {
  static const std::regex kQuantity("^[0-9]+(\\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$");
  return q.size() <= 32 && std::regex_match(q, kQuantity);
}

std::optional<uint32_t> ParseUid(const std::string& s) {
  if (s.empty() || s.size() > 10 || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  const uint64_t v = std::stoull(s);
  if (v > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(v);
}

json Add(const std::string& path, json value) { return json{{"op", "add"}, {"path", path}, {"value", std::move(value)}}; }

// The server settings a pod's annotations ask for, validated.
struct ServerSettings {
  std::string image;
  std::vector<std::string> args;
  std::vector<std::string> command;  // kCommandAnnotation: a program to run under fkserve launch
  std::string cpu_request, memory_request, memory_limit;
};

std::optional<std::string> ReadServerSettings(const json& annotations, const ServerDefaults& d, ServerSettings* out) {
  out->image = d.image;
  out->args = d.args;
  out->cpu_request = d.cpu_request;
  out->memory_request = d.memory_request;
  out->memory_limit = d.memory_limit;
  if (const json* image = Member(annotations, kImageAnnotation); image != nullptr) {
    if (!image->is_string() || image->get<std::string>().empty() || image->get<std::string>().size() > 512 ||
        image->get<std::string>().find_first_of(" \t\n") != std::string::npos) {
      return absl::StrCat("annotation ", kImageAnnotation, " must name a container image");
    }
    out->image = image->get<std::string>();
  }
  if (const json* args = Member(annotations, kArgsAnnotation); args != nullptr) {
    json parsed = args->is_string() ? json::parse(args->get<std::string>(), nullptr, /*allow_exceptions=*/false)
                                    : json();
    bool ok = parsed.is_array() && parsed.size() <= 256;
    for (const auto& a : parsed) ok = ok && a.is_string();
    if (!ok) {
      return absl::StrCat("annotation ", kArgsAnnotation,
                          " must be a JSON array of strings, e.g. [\"--socket=$(FUSEKEEPER_SOCKET)\", \"serve\"]");
    }
    out->args = parsed.get<std::vector<std::string>>();
  }
  if (const json* command = Member(annotations, kCommandAnnotation); command != nullptr) {
    json parsed = command->is_string() ? json::parse(command->get<std::string>(), nullptr, /*allow_exceptions=*/false)
                                       : json();
    bool ok = parsed.is_array() && !parsed.empty() && parsed.size() <= 256;
    for (const auto& a : parsed) ok = ok && a.is_string();
    if (!ok) {
      return absl::StrCat("annotation ", kCommandAnnotation,
                          " must be a non-empty JSON array of strings: the FUSE program and its arguments, e.g. "
                          "[\"s3fs\", \"mybucket\", \"{mountpoint}\", \"-f\"]");
    }
    if (Member(annotations, kImageAnnotation) == nullptr) {
      return absl::StrCat("annotation ", kCommandAnnotation, " needs ", kImageAnnotation,
                          ": the image that has the program");
    }
    if (Member(annotations, kArgsAnnotation) != nullptr) {
      return absl::StrCat("annotations ", kCommandAnnotation, " and ", kArgsAnnotation,
                          " exclude each other: the command is run under fkserve launch, whose arguments the webhook "
                          "sets");
    }
    out->command = parsed.get<std::vector<std::string>>();
  }
  for (auto [key, field] : {std::pair{kCpuRequestAnnotation, &out->cpu_request},
                            std::pair{kMemoryRequestAnnotation, &out->memory_request},
                            std::pair{kMemoryLimitAnnotation, &out->memory_limit}}) {
    const json* v = Member(annotations, key);
    if (v == nullptr) continue;
    if (!v->is_string() || !ValidQuantity(v->get<std::string>())) {
      return absl::StrCat("annotation ", key, " must be a Kubernetes quantity such as 100m, 64Mi or 1Gi");
    }
    *field = v->get<std::string>();
  }
  return std::nullopt;
}

}  // namespace

std::string PointerToken(const std::string& key) {
  std::string out;
  for (char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

std::vector<std::string> ClaimsOf(const json& pod) {
  std::vector<std::string> out;
  const json* spec = Member(pod, "spec");
  if (spec == nullptr) return out;
  for (const auto& v : ArrayOrEmpty(*spec, "volumes")) {
    const json* pvc = Member(v, "persistentVolumeClaim");
    if (pvc != nullptr && !String(*pvc, "claimName").empty()) out.push_back(String(*pvc, "claimName"));
  }
  return out;
}

namespace {

// The pod's volumes of ours: by name, their index in spec.volumes; which are inline FUSE volumes;
// every volume's index by name.
struct OurVolumes {
  std::map<std::string, size_t> ours;
  std::vector<std::string> inline_fuse;
  std::map<std::string, size_t> index;
};

OurVolumes FindOurVolumes(const json& volumes, const Policy& policy, const ClaimInfo& claims) {
  OurVolumes v;
  for (size_t i = 0; i < volumes.size(); ++i) {
    const json& vol = volumes[i];
    const std::string name = String(vol, "name");
    if (name.empty()) continue;
    v.index[name] = i;
    if (const json* csi = Member(vol, "csi"); csi != nullptr && String(*csi, "driver") == policy.driver) {
      v.ours[name] = i;
      const json* attrs = Member(*csi, "volumeAttributes");
      if (attrs != nullptr && String(*attrs, "kind") == "fuse") v.inline_fuse.push_back(name);
    } else if (const json* pvc = Member(vol, "persistentVolumeClaim"); pvc != nullptr) {
      auto c = claims.ours.find(String(*pvc, "claimName"));
      if (c != claims.ours.end() && c->second) v.ours[name] = i;
    }
  }
  return v;
}

// Mount policy: HostToContainer wherever the pod did not choose; a choice that keeps recovery
// out is kept, warned about, and listed (returned, for an annotation).
std::vector<std::string> SetPropagation(const json& spec, const OurVolumes& v, Mutation* m) {
  std::vector<std::string> kept;  // "container/volume (propagation)"
  for (const char* list : {"initContainers", "containers"}) {
    const json& containers = ArrayOrEmpty(spec, list);
    for (size_t ci = 0; ci < containers.size(); ++ci) {
      const json& mounts = ArrayOrEmpty(containers[ci], "volumeMounts");
      for (size_t mi = 0; mi < mounts.size(); ++mi) {
        const std::string volume = String(mounts[mi], "name");
        if (v.ours.count(volume) == 0) continue;
        if (Member(mounts[mi], "mountPropagation") == nullptr) {
          m->patch.push_back(Add(absl::StrCat("/spec/", list, "/", ci, "/volumeMounts/", mi, "/mountPropagation"),
                                 "HostToContainer"));
          continue;
        }
        const std::string p = String(mounts[mi], "mountPropagation");
        if (p == "HostToContainer" || p == "Bidirectional") continue;
        const std::string container = String(containers[ci], "name");
        const std::string shown = p.empty() ? "unset" : p;
        kept.push_back(absl::StrCat(container, "/", volume, " (", shown, ")"));
        // One short warning per mount: the API server may cut warnings over 256 characters.
        m->warnings.push_back(absl::StrCat("fusekeeper: container ", container, " keeps mountPropagation ", shown,
                                           " on volume ", volume, ": FUSE recovery cannot reach it; set "
                                           "HostToContainer (or leave the field out)"));
      }
    }
  }
  return kept;
}

// Who an injected server runs as: volumeAttributes serverUid/serverGid, else the policy's uid
// (written back into the attributes). A reason to deny, or nothing.
std::optional<std::string> ServerIdentity(const std::string& volume, const json* attrs, const Policy& policy,
                                          json* add_attrs, uint32_t* uid, uint32_t* gid) {
  *uid = policy.server.uid;
  if (const std::string s = String(*attrs, "serverUid"); !s.empty()) {
    auto parsed = ParseUid(s);
    if (!parsed) return absl::StrCat("volume ", volume, ": volumeAttributes.serverUid '", s, "' is not a numeric uid");
    *uid = *parsed;
  } else {
    (*add_attrs)["serverUid"] = std::to_string(*uid);
  }
  *gid = *uid;
  if (const std::string s = String(*attrs, "serverGid"); !s.empty()) {
    auto parsed = ParseUid(s);
    if (!parsed) return absl::StrCat("volume ", volume, ": volumeAttributes.serverGid '", s, "' is not a numeric gid");
    *gid = *parsed;
  }
  if (*uid == 0) {
    return absl::StrCat("volume ", volume, ": an injected FUSE server runs as non-root, so volumeAttributes."
                        "serverUid must not be 0 (the agent mounts; the server needs no privileges)");
  }
  return std::nullopt;
}

// The emptyDir holding the handoff socket: volumeAttributes.socketVolume (which must be one of the
// pod's emptyDirs), else one made for it (added to `new_volumes`). A reason to deny, or nothing.
std::optional<std::string> SocketVolume(const std::string& volume, const json* attrs, const json& volumes,
                                        OurVolumes& v, json* add_attrs, std::vector<json>* new_volumes,
                                        std::string* socket_volume) {
  *socket_volume = String(*attrs, "socketVolume");
  if (socket_volume->empty()) {
    *socket_volume = BoundedName("fusekeeper-sock-", volume);
    (*add_attrs)["socketVolume"] = *socket_volume;
    if (v.index.count(*socket_volume) == 0) {
      new_volumes->push_back(
          json{{"name", *socket_volume}, {"emptyDir", json{{"medium", "Memory"}, {"sizeLimit", "1Mi"}}}});
      v.index[*socket_volume] = SIZE_MAX;
      return std::nullopt;
    }
  }
  auto existing = v.index.find(*socket_volume);
  if (existing == v.index.end()) {
    return absl::StrCat("volume ", volume, ": volumeAttributes.socketVolume names '", *socket_volume,
                        "', which is not a volume of this pod");
  }
  if (existing->second != SIZE_MAX && Member(volumes[existing->second], "emptyDir") == nullptr) {
    return absl::StrCat("volume ", volume, ": volumeAttributes.socketVolume names '", *socket_volume,
                        "', which is not an emptyDir (the handoff socket lives in the pod's own emptyDir)");
  }
  return std::nullopt;
}

// The server's native sidecar for `volume`. With settings.command, the user's image runs its FUSE
// program under fkserve launch, from the tools the tools init container copies (`*tools_needed`).
json ServerContainer(const std::string& volume, const ServerSettings& settings, const Policy& policy, uint32_t uid,
                     uint32_t gid, const std::string& socket_volume, const std::string& socket_name,
                     bool* tools_needed) {
  ServerContainerSpec c;
  c.name = BoundedName(kServerPrefix, volume);
  c.image = settings.image;
  c.native_sidecar = true;
  c.args = settings.args;
  c.socket_path = absl::StrCat(kSocketDir, "/", socket_name);
  c.env = {{"FUSEKEEPER_READY_FILE", kReadyFile}, {"FUSEKEEPER_VOLUME", volume}};
  c.requests = {{"cpu", settings.cpu_request}, {"memory", settings.memory_request}};
  c.limits = {{"memory", settings.memory_limit}};
  c.user = ContainerUser{uid, gid};
  c.socket_dir = {socket_volume, kSocketDir};
  if (!settings.command.empty()) {
    // Run through the tools' own loader: nothing of the image's is needed.
    const std::string lib = absl::StrCat(kToolsDir, "/lib");
    c.command = {absl::StrCat(lib, "/", kToolsLoader), "--library-path", lib, absl::StrCat(kToolsDir, "/fkserve")};
    c.args = {"--socket=$(FUSEKEEPER_SOCKET)", "--ready_file=$(FUSEKEEPER_READY_FILE)",
              absl::StrCat("--fusermount=", kToolsDir, "/fkserve-fusermount"),
              absl::StrCat("--preload=", kToolsDir, "/libfkserve_preload.so"), "launch", "--"};
    c.args.insert(c.args.end(), settings.command.begin(), settings.command.end());
    c.mounts.push_back({kToolsContainer, kToolsDir, /*read_only=*/true});
    c.startup_probe = c.command;
    c.startup_probe.push_back(absl::StrCat("--ready_file=", kReadyFile));
    c.startup_probe.push_back("ready");
    *tools_needed = true;
  } else if (settings.image == policy.server.image) {
    // The app starts once the volume is served: creating it stats the mount, which would
    // otherwise wait for the server.
    c.startup_probe = {policy.fkserve_path, absl::StrCat("--ready_file=", kReadyFile), "ready"};
  }
  return ServerContainerJson(c);
}

// Once per pod, before every server: copies the launcher out of the fkserve image.
json ToolsContainer(const Policy& policy, uint32_t uid, uint32_t gid) {
  return json{{"name", kToolsContainer},
              {"image", policy.server.image},
              {"command", json::array({policy.fkserve_path, "install-tools", kToolsDir})},
              {"volumeMounts", json::array({json{{"name", kToolsContainer}, {"mountPath", kToolsDir}}})},
              {"securityContext", UnprivilegedSecurityContext(ContainerUser{uid, gid})},
              {"resources", json{{"requests", json{{"cpu", "10m"}, {"memory", "16Mi"}}}, {"limits", json{{"memory", "64Mi"}}}}}};
}

// Adds `new_volumes` and `new_containers` (first among the init containers, in volume order:
// later init containers may use the volume).
void AddToSpec(const json& spec, const std::vector<json>& new_volumes, const std::vector<json>& new_containers,
               Mutation* m) {
  for (const json& v : new_volumes) {
    m->patch.push_back(Member(spec, "volumes") == nullptr ? Add("/spec/volumes", json::array({v}))
                                                          : Add("/spec/volumes/-", v));
  }
  if (new_containers.empty()) return;
  if (Member(spec, "initContainers") == nullptr) {
    m->patch.push_back(Add("/spec/initContainers", json(new_containers)));
    return;
  }
  for (auto it = new_containers.rbegin(); it != new_containers.rend(); ++it) {
    m->patch.push_back(Add("/spec/initContainers/0", *it));
  }
}

// Server injection for each inline FUSE volume not served yet; false if denied (m->denied).
bool InjectServers(const json& spec, const json& annotations, const Policy& policy, OurVolumes& v, Mutation* m,
                   std::map<std::string, std::string>* set_annotations) {
  if (!policy.native_sidecars) {
    m->denied = absl::StrCat(
        "annotation ", kInjectAnnotation, " asks for the FUSE server as a native sidecar, which needs Kubernetes "
        "1.29+ (SidecarContainers); this cluster has none, and an ordinary init container would never let the pod "
        "start. Add the server to the pod yourself (see k8s/examples/inline-fuse-sidecar.yaml) and remove the "
        "annotation");
    return false;
  }
  ServerSettings settings;
  if (auto bad = ReadServerSettings(annotations, policy.server, &settings); bad.has_value()) {
    m->denied = *bad;
    return false;
  }
  const json& volumes = ArrayOrEmpty(spec, "volumes");
  std::set<std::string> init_names;
  for (const auto& c : ArrayOrEmpty(spec, "initContainers")) init_names.insert(String(c, "name"));
  std::vector<std::string> injected;
  if (const json* before = Member(annotations, kInjectedAnnotation); before != nullptr && before->is_string()) {
    injected.push_back(before->get<std::string>());
  }
  std::vector<json> new_containers, new_volumes;
  bool tools_added = false, any_new = false;
  for (const std::string& volume : v.inline_fuse) {
    if (init_names.count(BoundedName(kServerPrefix, volume)) > 0) continue;  // injected at an earlier admission
    const size_t vi = v.ours[volume];
    const json* attrs = Member(volumes[vi]["csi"], "volumeAttributes");
    json add_attrs = json::object();
    uint32_t uid, gid;
    std::string socket_volume;
    std::optional<std::string> bad = ServerIdentity(volume, attrs, policy, &add_attrs, &uid, &gid);
    if (!bad) bad = SocketVolume(volume, attrs, volumes, v, &add_attrs, &new_volumes, &socket_volume);
    if (bad) {
      m->denied = *bad;
      return false;
    }
    std::string socket_name = String(*attrs, "socketName");
    if (socket_name.empty()) socket_name = kDefaultSocketName;
    if (attrs == nullptr) {
      m->patch.push_back(Add(absl::StrCat("/spec/volumes/", vi, "/csi/volumeAttributes"), add_attrs));
    } else {
      for (const auto& [k, val] : add_attrs.items()) {
        m->patch.push_back(Add(absl::StrCat("/spec/volumes/", vi, "/csi/volumeAttributes/", PointerToken(k)), val));
      }
    }
    bool tools_needed = false;
    new_containers.push_back(
        ServerContainer(volume, settings, policy, uid, gid, socket_volume, socket_name, &tools_needed));
    if (tools_needed && !tools_added && init_names.count(kToolsContainer) == 0) {
      tools_added = true;
      new_volumes.push_back(json{{"name", kToolsContainer}, {"emptyDir", json{{"sizeLimit", "128Mi"}}}});
      new_containers.insert(new_containers.begin(), ToolsContainer(policy, uid, gid));
    }
    injected.push_back(volume);
    any_new = true;
  }
  AddToSpec(spec, new_volumes, new_containers, m);
  if (any_new) (*set_annotations)[kInjectedAnnotation] = absl::StrJoin(injected, ",");
  return true;
}

// The annotations to set, as patches (the metadata or its annotations made when missing).
void Annotate(const json* metadata, const json* annotations, const std::map<std::string, std::string>& set,
              Mutation* m) {
  if (set.empty()) return;
  if (metadata == nullptr) {
    m->patch.push_back(Add("/metadata", json{{"annotations", set}}));
  } else if (annotations == nullptr || !annotations->is_object()) {
    m->patch.push_back(Add("/metadata/annotations", json(set)));
  } else {
    for (const auto& [k, val] : set) m->patch.push_back(Add(absl::StrCat("/metadata/annotations/", PointerToken(k)), val));
  }
}

Mutation Mutate(const json& pod, const Policy& policy, const ClaimInfo& claims) {
  Mutation m;
  const json* spec = Member(pod, "spec");
  if (spec == nullptr || !spec->is_object()) {
    m.warnings.push_back("fusekeeper: the object has no pod spec; left alone");
    return m;
  }
  const json* metadata = Member(pod, "metadata");
  static const json kNoAnnotations = json::object();
  const json* annotations_ptr = metadata != nullptr ? Member(*metadata, "annotations") : nullptr;
  const json& annotations = annotations_ptr != nullptr && annotations_ptr->is_object() ? *annotations_ptr : kNoAnnotations;
  OurVolumes v = FindOurVolumes(ArrayOrEmpty(*spec, "volumes"), policy, claims);
  m.warnings = claims.warnings;
  bool inject = false;
  if (const json* a = Member(annotations, kInjectAnnotation); a != nullptr) {
    const std::string value = a->is_string() ? a->get<std::string>() : a->dump();
    if (value != "true" && value != "false") {
      m.denied = absl::StrCat("annotation ", kInjectAnnotation, " must be \"true\" or \"false\", not \"", value, "\"");
      return m;
    }
    inject = value == "true";
  }
  if (v.ours.empty()) {
    if (inject) {
      m.warnings.push_back(absl::StrCat("fusekeeper: annotation ", kInjectAnnotation, " is set, but the pod has no ",
                                        policy.driver, " volume: nothing injected"));
    }
    return m;
  }
  std::map<std::string, std::string> set_annotations;
  if (const std::vector<std::string> kept = SetPropagation(*spec, v, &m); !kept.empty()) {
    set_annotations[kPropagationKeptAnnotation] = absl::StrJoin(kept, ", ");
  }
  if (inject && v.inline_fuse.empty()) {
    m.warnings.push_back(absl::StrCat("fusekeeper: annotation ", kInjectAnnotation,
                                      " is set, but the pod has no inline volume of kind fuse: nothing injected"));
  } else if (inject && !InjectServers(*spec, annotations, policy, v, &m, &set_annotations)) {
    return m;
  }
  Annotate(metadata, annotations_ptr, set_annotations, &m);
  return m;
}

}  // namespace

Mutation MutatePod(const json& pod, const Policy& policy, const ClaimInfo& claims) {
  Mutation m = Mutate(pod, policy, claims);
  if (m.denied) m.patch = json::array();  // a denied pod is not changed either
  return m;
}

}  // namespace fusekeeper::webhook
