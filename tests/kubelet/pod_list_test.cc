#include "agent/kubelet/pod_list.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

std::string Pod(const std::string& uid, const std::string& sidecar_id, int restarts, const std::string& started) {
  return absl::StrCat(R"({"metadata":{"namespace":"ns","name":"p-)", uid, R"(","uid":")", uid, R"("},
    "status":{"containerStatuses":[{"name":"app","restartCount":0,"containerID":"containerd://a","state":{"running":{"startedAt":"2026-01-01T00:00:00Z"}}}],
    "initContainerStatuses":[{"name":"fuse","restartCount":)", restarts, R"(,"containerID":")", sidecar_id,
                      R"(","state":)", started.empty() ? R"({"waiting":{}})" : absl::StrCat(R"({"running":{"startedAt":")", started, R"("}})"),
                      "}]}}");
}
std::string List(const std::vector<std::string>& pods) {
  std::string items;
  for (const auto& p : pods) absl::StrAppend(&items, items.empty() ? "" : ",", p);
  return absl::StrCat(R"({"kind":"PodList","apiVersion":"v1","items":[)", items, "]}");
}

TEST(PodListTest, ParsesPodsAndBothContainerLists) {
  auto pods = ParsePodList(List({Pod("u1", "containerd://s1", 2, "2026-01-01T00:00:05Z")}));
  ASSERT_TRUE(pods.ok()) << pods.status();
  ASSERT_EQ(pods->size(), 1u);
  const PodStatus& p = (*pods)[0];
  EXPECT_EQ(p.namespace_, "ns");
  EXPECT_EQ(p.name, "p-u1");
  EXPECT_EQ(p.uid, "u1");
  ASSERT_EQ(p.containers.size(), 2u);
  EXPECT_FALSE(p.containers[0].init);
  EXPECT_TRUE(p.containers[1].init) << "native sidecars are init containers";
  EXPECT_EQ(p.containers[1].restart_count, 2);
  EXPECT_EQ(p.containers[1].container_id, "containerd://s1");
  EXPECT_EQ(p.containers[1].started_at, "2026-01-01T00:00:05Z");
}

TEST(PodListTest, EmptyAndNullItems) {
  EXPECT_TRUE(ParsePodList(R"({"kind":"PodList","items":[]})")->empty());
  EXPECT_TRUE(ParsePodList(R"({"kind":"PodList","items":null})")->empty());
}

TEST(PodListTest, MalformedInputIsAnErrorNamingTheProblem) {
  for (const char* bad : {"", "\x00{", "[]", "{}", R"({"items":{}})", R"({"items":[1]})",
                          R"({"items":[{"metadata":{"name":"x"}}]})",
                          R"({"items":[{"metadata":{"uid":"u"},"status":{"containerStatuses":{}}}]})",
                          R"({"items":[{"metadata":{"uid":"u"},"status":{"containerStatuses":[{"name":"a","restartCount":"3"}]}}]})"}) {
    auto r = ParsePodList(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) EXPECT_TRUE(absl::StartsWith(r.status().message(), "PodList: ")) << r.status();
  }
}

TEST(RestartDetectorTest, ReportsRestartsOnceNotFirstSightings) {
  RestartDetector d;
  EXPECT_TRUE(d.Update(*ParsePodList(List({Pod("u1", "containerd://s1", 0, "t0")}))).empty());
  EXPECT_TRUE(d.Update(*ParsePodList(List({Pod("u1", "containerd://s1", 0, "t0")}))).empty()) << "no change";
  // The sidecar restarted: the count goes up (the new instance may not run yet).
  auto r = d.Update(*ParsePodList(List({Pod("u1", "", 1, "")})));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].container, "fuse");
  EXPECT_EQ(r[0].pod_uid, "u1");
  EXPECT_EQ(r[0].restart_count, 1);
  EXPECT_TRUE(d.Update(*ParsePodList(List({Pod("u1", "containerd://s2", 1, "t1")}))).empty())
      << "the same restart, now running, is not reported twice";
  // A new container id with the same count (the count lags) is a restart too.
  EXPECT_EQ(d.Update(*ParsePodList(List({Pod("u1", "containerd://s3", 1, "t2")}))).size(), 1u);
  // A pod that went away and came back with the same uid is a first sighting again.
  EXPECT_TRUE(d.Update(*ParsePodList(List({}))).empty());
  EXPECT_TRUE(d.Update(*ParsePodList(List({Pod("u1", "containerd://s9", 5, "t9")}))).empty());
}

}  // namespace
}  // namespace fusekeeper
