// What the admission webhook does to a pod that uses fusekeeper volumes, as pure logic on the
// pod's JSON (nlohmann::json): a JSON Patch (RFC 6902), warnings for the user, or a denial.
//
// Our volumes: CSI inline volumes of our driver, and PersistentVolumeClaims whose PV (or, while
// unbound, whose StorageClass's provisioner) is our driver; the caller resolves the claims first
// (ClaimsOf, then ClaimDrivers).
//
// Mount policy: every volumeMount of one of our volumes, in init, sidecar and regular
// containers, gets `mountPropagation: HostToContainer` unless the pod set one; a pod that set
// None keeps it, and is told (a warning and an annotation) that recovery cannot reach it.
//
// Server injection (opt-in, annotation kInjectAnnotation "true"): each inline `kind: fuse`
// volume gets its FUSE server as a native sidecar (an init container with restartPolicy
// Always), first among the init containers, running as the volume's serverUid/serverGid,
// non-root, read-only root filesystem, no privileges; the handoff socket's emptyDir is added and
// named in the volume's socketVolume. Re-admission never injects twice.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace fusekeeper::webhook {

// Annotations a pod may carry (all under our driver's domain).
inline constexpr char kInjectAnnotation[] = "fusekeeper.csi/inject-server";         // "true" | "false"
inline constexpr char kImageAnnotation[] = "fusekeeper.csi/server-image";
inline constexpr char kArgsAnnotation[] = "fusekeeper.csi/server-args";             // JSON array of strings
// An ordinary FUSE program in the server image (JSON array: the program and its arguments, with
// {mountpoint} or /dev/fd/{fd}): the sidecar runs it under fkserve launch, which an init
// container copies from the fkserve image (`fkserve install-tools`), so the image needs nothing
// of ours. Needs kImageAnnotation; excludes kArgsAnnotation.
inline constexpr char kCommandAnnotation[] = "fusekeeper.csi/server-command";
inline constexpr char kCpuRequestAnnotation[] = "fusekeeper.csi/server-cpu-request";
inline constexpr char kMemoryRequestAnnotation[] = "fusekeeper.csi/server-memory-request";
inline constexpr char kMemoryLimitAnnotation[] = "fusekeeper.csi/server-memory-limit";
// Set by the webhook.
inline constexpr char kInjectedAnnotation[] = "fusekeeper.csi/injected-servers";    // volume names
inline constexpr char kPropagationKeptAnnotation[] = "fusekeeper.csi/propagation-kept";
// Prefix of injected containers' names: kServerPrefix + volume name.
inline constexpr char kServerPrefix[] = "fusekeeper-server-";
// Where the injected server sees the socket's emptyDir.
inline constexpr char kSocketDir[] = "/fusekeeper";
// The init container that copies fkserve's launcher into kToolsDir (an emptyDir of that name),
// for servers that run the user's own image (kCommandAnnotation).
inline constexpr char kToolsContainer[] = "fusekeeper-tools";
inline constexpr char kToolsDir[] = "/fusekeeper-tools";
// The dynamic loader `fkserve install-tools` copies (amd64 nodes).
inline constexpr char kToolsLoader[] = "ld-linux-x86-64.so.2";

struct ServerDefaults {
  std::string image = "fusekeeper/fkserve:0.1.0";
  // $(FUSEKEEPER_SOCKET), $(FUSEKEEPER_READY_FILE) and $(FUSEKEEPER_VOLUME) are set in the
  // server's environment (Kubernetes expands them in args).
  std::vector<std::string> args = {"--socket=$(FUSEKEEPER_SOCKET)", "--ready_file=$(FUSEKEEPER_READY_FILE)", "serve",
                                   "--root=/"};
  std::string cpu_request = "10m";
  std::string memory_request = "32Mi";
  std::string memory_limit = "256Mi";
  uint32_t uid = 65534;  // a volume without serverUid gets this one (and says so in its attributes)
};

struct Policy {
  std::string driver = "fusekeeper.csi";
  ServerDefaults server;
  // Whether the cluster runs native sidecars (Kubernetes 1.29+). Without them injection is refused.
  bool native_sidecars = true;
  // fkserve's path in the server image: a server running the default image gets a startupProbe
  // (`fkserve --ready_file=… ready`) so the app starts only once the volume is served.
  std::string fkserve_path = "/usr/local/bin/fkserve";
};

// The claims (spec.volumes[].persistentVolumeClaim.claimName) a pod uses.
std::vector<std::string> ClaimsOf(const nlohmann::json& pod);

// claim name → whether it is one of our volumes; a claim missing here is not ours. Lookup
// problems go to warnings.
struct ClaimInfo {
  std::map<std::string, bool> ours;
  std::vector<std::string> warnings;
};

struct Mutation {
  nlohmann::json patch = nlohmann::json::array();  // empty: nothing to change
  std::vector<std::string> warnings;
  std::optional<std::string> denied;  // the reason, shown to the user
};

// Never throws; a pod it cannot make sense of is left alone (with a warning) unless it asked for
// injection, which then is denied with the reason.
Mutation MutatePod(const nlohmann::json& pod, const Policy& policy, const ClaimInfo& claims);

// RFC 6901: "~" → "~0", "/" → "~1".
std::string PointerToken(const std::string& key);

}  // namespace fusekeeper::webhook
