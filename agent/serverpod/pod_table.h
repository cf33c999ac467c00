// What `fkctl ServerPods` prints: the cluster's server pods (or one node's), by volume, with
// each one's node, image and state, and per volume which image runs on how many nodes — a
// roll's progress across nodes at a glance. Pure; any thread.
#pragma once

#include <string>
#include <vector>

#include "agent/serverpod/api_objects.h"

namespace fusekeeper {

// `node`: only that node's pods; empty: all.
std::string ServerPodTable(std::vector<ListedServerPod> pods, const std::string& node);

}  // namespace fusekeeper
