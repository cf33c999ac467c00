// The server pod table (`fkctl ServerPods`): pure, and through the fkctl binary against the
// API-server double over real HTTPS, as an operator runs it in an agent's container.
#include "agent/serverpod/pod_table.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "agent/serverpod/pod_manifest.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_kube.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

ListedServerPod Pod(const std::string& volume, const std::string& node, const std::string& image,
                    const std::string& phase, bool ready = false, bool terminating = false) {
  ListedServerPod p;
  p.name = "fk-" + volume + "-" + node;
  p.uid = "uid-" + p.name;
  p.volume_id = volume;
  p.node = node;
  p.image = image;
  p.phase = phase;
  p.ready = ready;
  p.terminating = terminating;
  return p;
}

TEST(ServerPodTableTest, ShowsEachPodAndHowManyNodesRunEachImage) {
  const std::string t = ServerPodTable({Pod("vol-b", "n2", "fs:2", "Running", true), Pod("vol-a", "n1", "fs:1", "Pending"),
                                        Pod("vol-b", "n1", "fs:1", "Running", false),
                                        Pod("vol-b", "n3", "fs:2", "Running", true),
                                        Pod("vol-b", "n4", "fs:1", "Running", true, /*terminating=*/true)},
                                       "");
  std::vector<std::string> lines = absl::StrSplit(t, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 8u) << t;
  EXPECT_TRUE(absl::StartsWith(lines[0], "VOLUME")) << t;
  // Sorted by volume, then node; columns aligned.
  EXPECT_TRUE(absl::StartsWith(lines[1], "vol-a   n1    fs:1")) << t;
  EXPECT_TRUE(absl::StrContains(lines[1], "Pending")) << t;
  EXPECT_TRUE(absl::StrContains(lines[2], "Running,not-ready")) << t;
  EXPECT_TRUE(absl::StrContains(lines[3], "Running,ready")) << t;
  EXPECT_TRUE(absl::StrContains(lines[5], "Terminating")) << t;
  EXPECT_EQ(lines[1].find("fk-"), lines[2].find("fk-")) << t;
  // A terminating pod counts for no node.
  EXPECT_EQ(lines[6], "volume vol-a: fs:1 on 1 node") << t;
  EXPECT_EQ(lines[7], "volume vol-b: fs:1 on 1 node, fs:2 on 2 nodes") << t;
}

TEST(ServerPodTableTest, OneNodeOrNone) {
  const std::string t = ServerPodTable({Pod("vol-a", "n1", "fs:1", "Running", true), Pod("vol-a", "n2", "fs:2", "Running", true)}, "n2");
  EXPECT_FALSE(absl::StrContains(t, " n1 ")) << t;
  EXPECT_TRUE(absl::StrContains(t, "volume vol-a: fs:2 on 1 node")) << t;
  EXPECT_TRUE(absl::StrContains(ServerPodTable({}, "n9"), "(no server pods on node n9)"));
}

class FkctlServerPodsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    kube_ = std::make_unique<FakeKube>(dir_.path());
    ASSERT_TRUE(kube_->ok()) << kube_->Diagnostics();
    std::filesystem::create_directories(dir_.path() + "/sa");
    { std::ofstream(dir_.path() + "/sa/token") << "secret-token\n"; }
    std::filesystem::copy_file(kube_->ca_file(), dir_.path() + "/sa/ca.crt");
  }
  // Makes the pod the agent of `node` would make, through the double's API.
  void Make(const std::string& volume, const std::string& node, const std::string& image) {
    ServerPodSettings s;
    s.namespace_ = "fk-system";
    s.node = node;
    state::ServerPod spec;
    spec.set_image(image);
    ASSERT_EQ(kube_->Call("POST", "/api/v1/namespaces/fk-system/pods", BuildServerPod(s, volume, spec, 1000, 1000).json), 201);
  }
  // Runs fkctl as in an agent's container; stdout goes to the captured stderr.
  std::pair<int, std::string> Fkctl(std::vector<std::string> flags, const std::string& port = "") {
    std::string cmd = "exec " + RunfilePath("agent/fkctl") + " --kube_secrets_dir=" + dir_.path() + "/sa";
    for (const auto& f : flags) cmd += " " + f;
    cmd += " ServerPods 1>&2";
    Subprocess p({"/bin/sh", "-c", cmd},
                 {"KUBERNETES_SERVICE_HOST=127.0.0.1",
                  "KUBERNETES_SERVICE_PORT=" + (port.empty() ? std::to_string(kube_->port()) : port),
                  "POD_NAMESPACE=fk-system"});
    auto st = p.Wait(std::chrono::seconds(30));
    return {st.has_value() && WIFEXITED(*st) ? WEXITSTATUS(*st) : -1, p.Stderr()};
  }

  ShortTempDir dir_;
  std::unique_ptr<FakeKube> kube_;
};

TEST_F(FkctlServerPodsTest, ListsEveryNodesServerPodsWithTheirImages) {
  Make("vol-1", "node-a", "team/fs:1");
  Make("vol-1", "node-b", "team/fs:2");
  Make("vol-2", "node-a", "team/other:3");
  ASSERT_EQ(kube_->Call("PATCH", "/api/v1/namespaces/fk-system/pods/" + [] {
    ServerPodSettings s;
    s.namespace_ = "fk-system";
    s.node = "node-b";
    state::ServerPod spec;
    spec.set_image("team/fs:2");
    return BuildServerPod(s, "vol-1", spec, 1000, 1000).name;
  }() + "/status", R"({"status":{"phase":"Running","containerStatuses":[{"name":"server","ready":true}]}})"), 200);
  auto [rc, out] = Fkctl({});
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "volume vol-1: team/fs:1 on 1 node, team/fs:2 on 1 node")) << out;
  EXPECT_TRUE(absl::StrContains(out, "volume vol-2: team/other:3 on 1 node")) << out;
  EXPECT_TRUE(absl::StrContains(out, "node-b  team/fs:2     Running,ready")) << out;
  // The request carried the service account's token and the managed-by selector.
  bool asked = false;
  for (const auto& line : kube_->Log()) {
    asked |= absl::StrContains(line, "labelSelector=app.kubernetes.io/managed-by%3Dfusekeeper") &&
             absl::StrContains(line, "secret-token");
  }
  EXPECT_TRUE(asked) << "no listing with the token and selector in the double's log";
  auto [rc_b, only_b] = Fkctl({"--node=node-b"});
  ASSERT_EQ(rc_b, 0) << only_b;
  EXPECT_FALSE(absl::StrContains(only_b, "node-a")) << only_b;
}

TEST_F(FkctlServerPodsTest, AnUnreachableOrRefusingApiServerIsAClearError) {
  auto [rc, out] = Fkctl({}, "1");
  EXPECT_EQ(rc, 14) << out;  // UNAVAILABLE
  EXPECT_TRUE(absl::StrContains(out, "listing the server pods in namespace fk-system")) << out;
  kube_->SetMode("403");
  auto [rc2, out2] = Fkctl({});
  EXPECT_EQ(rc2, 7) << out2;  // PERMISSION_DENIED
  EXPECT_TRUE(absl::StrContains(out2, "needs pods list")) << out2;
  auto [rc3, out3] = Fkctl({"--kube_secrets_dir=/nonexistent"});
  EXPECT_EQ(rc3, 9) << out3;  // FAILED_PRECONDITION
  EXPECT_TRUE(absl::StrContains(out3, "no service account token")) << out3;
}

}  // namespace
}  // namespace fusekeeper
