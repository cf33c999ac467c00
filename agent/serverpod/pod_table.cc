#include "agent/serverpod/pod_table.h"

#include <algorithm>
#include <array>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fusekeeper {
namespace {

std::string State(const ListedServerPod& p) {
  if (p.terminating) return "Terminating";
  std::string s = p.phase.empty() ? "Unknown" : p.phase;
  if (p.phase == "Running") s += p.ready ? ",ready" : ",not-ready";
  return s;
}

std::string OrDash(const std::string& s) { return s.empty() ? "-" : s; }

}  // namespace

std::string ServerPodTable(std::vector<ListedServerPod> pods, const std::string& node) {
  if (!node.empty()) {
    pods.erase(std::remove_if(pods.begin(), pods.end(), [&](const ListedServerPod& p) { return p.node != node; }),
               pods.end());
  }
  std::sort(pods.begin(), pods.end(), [](const ListedServerPod& a, const ListedServerPod& b) {
    return std::tie(a.volume_id, a.node, a.name) < std::tie(b.volume_id, b.node, b.name);
  });
  std::vector<std::array<std::string, 5>> rows = {{"VOLUME", "NODE", "IMAGE", "STATE", "POD"}};
  // Per volume: image → the nodes that run it (pods not going away).
  std::map<std::string, std::map<std::string, std::set<std::string>>> runs;
  for (const auto& p : pods) {
    rows.push_back({OrDash(p.volume_id), OrDash(p.node), OrDash(p.image), State(p), p.name});
    if (!p.terminating) runs[OrDash(p.volume_id)][OrDash(p.image)].insert(p.node);
  }
  std::array<size_t, 5> width{};
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  std::string out;
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
    }
    out += line + "\n";
  }
  if (pods.empty()) out += "(no server pods" + (node.empty() ? std::string() : " on node " + node) + ")\n";
  for (const auto& [volume, images] : runs) {
    std::vector<std::string> parts;
    for (const auto& [image, nodes] : images) {
      parts.push_back(absl::StrCat(image, " on ", nodes.size(), nodes.size() == 1 ? " node" : " nodes"));
    }
    out += absl::StrCat("volume ", volume, ": ", absl::StrJoin(parts, ", "), "\n");
  }
  return out;
}

}  // namespace fusekeeper
