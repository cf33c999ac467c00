// The container that runs a FUSE server, as both its makers build it: the agent's server pods
// for staged volumes (agent/serverpod/pod_manifest.h) and the webhook's sidecars for inline
// volumes (agent/webhook/pod_mutation.h). Whatever else differs, every server container is
// unprivileged (no capabilities, no privilege escalation, not privileged, a read-only root),
// has the directory of the agent's handoff socket mounted and that socket's path in
// FUSEKEEPER_SOCKET, and says its resources explicitly. Pure; any thread.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"

namespace fusekeeper {

struct ContainerUser {
  uint32_t uid = 0;
  uint32_t gid = 0;
};

struct ContainerMount {
  std::string volume;
  std::string path;
  bool read_only = false;
};

struct ServerContainerSpec {
  std::string name;
  std::string image;
  std::string image_pull_policy;  // empty: the cluster's default
  // An init container with restartPolicy Always: a native sidecar, running beside the app.
  bool native_sidecar = false;
  std::vector<std::string> command;  // empty: the image's entrypoint
  std::vector<std::string> args;     // empty: the image's
  std::string socket_path;           // FUSEKEEPER_SOCKET
  std::vector<std::pair<std::string, std::string>> env;  // after FUSEKEEPER_SOCKET
  std::map<std::string, std::string> requests;
  std::map<std::string, std::string> limits;  // empty: none
  // The container's own user (a sidecar in someone else's pod); none: the pod's.
  std::optional<ContainerUser> user;
  ContainerMount socket_dir;  // the handoff socket's directory
  std::vector<ContainerMount> mounts;  // after it
  std::vector<std::string> startup_probe;  // an exec probe run until it passes; empty: none
};

// In a fixed order (the agent hashes its server pods' specs into their names: the same spec must
// give the same bytes across agent versions).
nlohmann::ordered_json ServerContainerJson(const ServerContainerSpec& spec);

// The securityContext of every container fusekeeper adds to a pod: as `user` if given, no
// capabilities, no privilege escalation, not privileged, a read-only root.
nlohmann::ordered_json UnprivilegedSecurityContext(const std::optional<ContainerUser>& user);

}  // namespace fusekeeper
