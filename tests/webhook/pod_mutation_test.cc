// MutatePod on recorded pod specs: the JSON Patch is applied to the pod (nlohmann's RFC 6902
// implementation) and the result is checked field by field.
#include "agent/webhook/pod_mutation.h"

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/webhook/recorded_pods.h"

namespace fusekeeper::webhook {
namespace {

using json = nlohmann::json;

json Recorded(const std::string& name) { return RecordedPod(name); }

// The pod after its mutation's patch (which must apply cleanly).
json Patched(const json& pod, const Mutation& m) { return pod.patch(m.patch); }

const json* Container(const json& pod, const char* list, const std::string& name) {
  if (!pod["spec"].contains(list)) return nullptr;
  for (const auto& c : pod["spec"][list]) {
    if (c["name"] == name) return &c;
  }
  return nullptr;
}

const json* Volume(const json& pod, const std::string& name) {
  for (const auto& v : pod["spec"]["volumes"]) {
    if (v["name"] == name) return &v;
  }
  return nullptr;
}

TEST(PodMutationTest, InlineFuseVolumeOptedInGetsItsServerAsANativeSidecarAndHostToContainerEverywhere) {
  const json pod = Recorded("inline_fuse_opt_in.json");
  const Mutation m = MutatePod(pod, Policy{}, ClaimInfo{});
  ASSERT_FALSE(m.denied.has_value()) << *m.denied;
  const json out = Patched(pod, m);

  // Mount policy: the app and the init container that reads the volume; not other volumes.
  EXPECT_EQ((*Container(out, "containers", "app"))["volumeMounts"][0]["mountPropagation"], "HostToContainer");
  EXPECT_FALSE((*Container(out, "containers", "app"))["volumeMounts"][1].contains("mountPropagation"));
  EXPECT_EQ((*Container(out, "initContainers", "warm-cache"))["volumeMounts"][0]["mountPropagation"], "HostToContainer");

  // The server: first among the init containers (warm-cache reads the volume), a native sidecar.
  ASSERT_EQ(out["spec"]["initContainers"].size(), 2u);
  const json& server = out["spec"]["initContainers"][0];
  EXPECT_EQ(server["name"], "fusekeeper-server-data");
  EXPECT_EQ(server["restartPolicy"], "Always");
  EXPECT_EQ(server["image"], "fusekeeper/fkserve:0.1.0");
  const json& sc = server["securityContext"];
  EXPECT_EQ(sc["runAsUser"], 1000) << "the volume's serverUid";
  EXPECT_EQ(sc["runAsGroup"], 1000) << "serverGid defaults to serverUid";
  EXPECT_EQ(sc["runAsNonRoot"], true);
  EXPECT_EQ(sc["readOnlyRootFilesystem"], true);
  EXPECT_EQ(sc["allowPrivilegeEscalation"], false);
  EXPECT_EQ(sc["capabilities"]["drop"], json::array({"ALL"}));
  EXPECT_EQ(server["resources"]["requests"]["memory"], "32Mi");
  EXPECT_EQ(server["resources"]["limits"]["memory"], "256Mi");
  EXPECT_TRUE(server.contains("startupProbe")) << "the default (fkserve) server gets its readiness probe";

  // The socket: an emptyDir the server mounts at /fusekeeper, named in the volume's attributes.
  const json& attrs = (*Volume(out, "data"))["csi"]["volumeAttributes"];
  const std::string socket_volume = attrs["socketVolume"];
  ASSERT_NE(Volume(out, socket_volume), nullptr);
  EXPECT_TRUE((*Volume(out, socket_volume)).contains("emptyDir"));
  EXPECT_EQ(server["volumeMounts"][0]["name"], socket_volume);
  EXPECT_EQ(server["volumeMounts"][0]["mountPath"], "/fusekeeper");
  EXPECT_EQ(attrs["serverUid"], "1000") << "kept as the pod wrote it";
  EXPECT_EQ(attrs["bucket"], "models") << "the server's own attributes untouched";
  bool socket_env = false;
  for (const auto& e : server["env"]) socket_env = socket_env || (e["name"] == "FUSEKEEPER_SOCKET" && e["value"] == "/fusekeeper/fusekeeper.sock");
  EXPECT_TRUE(socket_env);
  EXPECT_EQ(out["metadata"]["annotations"]["fusekeeper.csi/injected-servers"], "data");

  // Admitted again (reinvocation, a second webhook pass): nothing more to do.
  const Mutation again = MutatePod(out, Policy{}, ClaimInfo{});
  EXPECT_FALSE(again.denied.has_value());
  EXPECT_TRUE(again.patch.empty()) << again.patch.dump();
}

TEST(PodMutationTest, ClaimsOfOurDriverGetHostToContainerOthersAreUntouched) {
  const json pod = Recorded("claims.json");
  EXPECT_EQ(ClaimsOf(pod), (std::vector<std::string>{"shared-dataset", "ebs-claim"}));
  ClaimInfo claims;
  claims.ours = {{"shared-dataset", true}, {"ebs-claim", false}};
  const Mutation m = MutatePod(pod, Policy{}, claims);
  ASSERT_FALSE(m.denied.has_value());
  const json out = Patched(pod, m);
  EXPECT_EQ((*Container(out, "containers", "app"))["volumeMounts"][0]["mountPropagation"], "HostToContainer");
  EXPECT_FALSE((*Container(out, "containers", "app"))["volumeMounts"][1].contains("mountPropagation"));
  EXPECT_EQ((*Container(out, "containers", "logger"))["volumeMounts"][0]["mountPropagation"], "HostToContainer");
  EXPECT_FALSE(out.contains("/spec/initContainers"_json_pointer)) << "no injection without opt-in";
}

TEST(PodMutationTest, PodsWithoutOurVolumesAreNeverTouched) {
  for (const char* name : {"unrelated.json", "claims.json"}) {
    const json pod = Recorded(name);
    const Mutation m = MutatePod(pod, Policy{}, ClaimInfo{});  // claims.json: none of its claims is ours
    EXPECT_TRUE(m.patch.empty()) << name << ": " << m.patch.dump();
    EXPECT_TRUE(m.warnings.empty()) << name;
    EXPECT_FALSE(m.denied.has_value()) << name;
  }
}

TEST(PodMutationTest, AnExplicitPropagationIsKeptAndNoneIsReported) {
  const json pod = Recorded("explicit_none.json");
  const Mutation m = MutatePod(pod, Policy{}, ClaimInfo{});
  ASSERT_FALSE(m.denied.has_value());
  const json out = Patched(pod, m);
  EXPECT_EQ(out["spec"]["containers"][0]["volumeMounts"][0]["mountPropagation"], "None");
  EXPECT_EQ(out["spec"]["containers"][0]["volumeMounts"][1]["mountPropagation"], "Bidirectional");
  ASSERT_EQ(m.warnings.size(), 1u);
  EXPECT_TRUE(absl::StrContains(m.warnings[0], "container app keeps mountPropagation None on volume data"))
      << m.warnings[0];
  EXPECT_TRUE(absl::StrContains(m.warnings[0], "recovery cannot reach")) << m.warnings[0];
  EXPECT_LE(m.warnings[0].size(), 256u) << "the API server may cut longer warnings";
  EXPECT_EQ(out["metadata"]["annotations"]["fusekeeper.csi/propagation-kept"], "app/data (None)");
}

TEST(PodMutationTest, BadRequestsAreDeniedSayingWhatIsWrong) {
  struct Case {
    const char* annotation;
    std::string value;
    const char* says;
  };
  const Case cases[] = {
      {"fusekeeper.csi/inject-server", "yes", "must be \"true\" or \"false\""},
      {"fusekeeper.csi/server-args", "--root=/", "JSON array of strings"},
      {"fusekeeper.csi/server-args", "[1,2]", "JSON array of strings"},
      {"fusekeeper.csi/server-memory-limit", "lots", "quantity"},
      {"fusekeeper.csi/server-image", "", "container image"},
      {"fusekeeper.csi/server-command", "s3fs bucket", "non-empty JSON array of strings"},
      {"fusekeeper.csi/server-command", "[]", "non-empty JSON array of strings"},
      {"fusekeeper.csi/server-command", "[\"s3fs\"]", "needs fusekeeper.csi/server-image"},
  };
  for (const auto& c : cases) {
    json pod = Recorded("inline_fuse_opt_in.json");
    pod["metadata"]["annotations"][c.annotation] = c.value;
    const Mutation m = MutatePod(pod, Policy{}, ClaimInfo{});
    ASSERT_TRUE(m.denied.has_value()) << c.annotation << "=" << c.value;
    EXPECT_TRUE(absl::StrContains(*m.denied, c.says)) << *m.denied;
    EXPECT_TRUE(m.patch.empty());
  }
  json root = Recorded("inline_fuse_opt_in.json");
  root["spec"]["volumes"][1]["csi"]["volumeAttributes"]["serverUid"] = "0";
  EXPECT_TRUE(absl::StrContains(MutatePod(root, Policy{}, ClaimInfo{}).denied.value_or(""), "must not be 0"));
  json not_empty_dir = Recorded("inline_fuse_opt_in.json");
  not_empty_dir["spec"]["volumes"][1]["csi"]["volumeAttributes"]["socketVolume"] = "data";
  EXPECT_TRUE(absl::StrContains(MutatePod(not_empty_dir, Policy{}, ClaimInfo{}).denied.value_or(""), "not an emptyDir"));
  json missing = Recorded("inline_fuse_opt_in.json");
  missing["spec"]["volumes"][1]["csi"]["volumeAttributes"]["socketVolume"] = "nope";
  EXPECT_TRUE(absl::StrContains(MutatePod(missing, Policy{}, ClaimInfo{}).denied.value_or(""), "not a volume of this pod"));
}

TEST(PodMutationTest, WithoutNativeSidecarsInjectionIsRefusedNotBroken) {
  Policy old_cluster;
  old_cluster.native_sidecars = false;
  const Mutation m = MutatePod(Recorded("inline_fuse_opt_in.json"), old_cluster, ClaimInfo{});
  ASSERT_TRUE(m.denied.has_value());
  EXPECT_TRUE(absl::StrContains(*m.denied, "1.29")) << *m.denied;
  // Without opt-in, such clusters still get the mount policy.
  json plain = Recorded("inline_fuse_opt_in.json");
  plain["metadata"]["annotations"].erase("fusekeeper.csi/inject-server");
  const Mutation p = MutatePod(plain, old_cluster, ClaimInfo{});
  EXPECT_FALSE(p.denied.has_value());
  EXPECT_EQ(p.patch.size(), 2u) << p.patch.dump();
}

TEST(PodMutationTest, ThePodsOwnServerSettingsAndSocketVolumeAreUsed) {
  json pod = Recorded("inline_fuse_opt_in.json");
  auto& ann = pod["metadata"]["annotations"];
  ann["fusekeeper.csi/server-image"] = "registry.example/s3-fuse:2.1";
  ann["fusekeeper.csi/server-args"] = R"json(["--socket=$(FUSEKEEPER_SOCKET)", "--bucket=models"])json";
  ann["fusekeeper.csi/server-cpu-request"] = "250m";
  ann["fusekeeper.csi/server-memory-limit"] = "1Gi";
  pod["spec"]["volumes"].push_back(json{{"name", "sock"}, {"emptyDir", json::object()}});
  pod["spec"]["volumes"][1]["csi"]["volumeAttributes"]["socketVolume"] = "sock";
  pod["spec"]["volumes"][1]["csi"]["volumeAttributes"]["socketName"] = "s3.sock";
  const Mutation m = MutatePod(pod, Policy{}, ClaimInfo{});
  ASSERT_FALSE(m.denied.has_value()) << *m.denied;
  const json out = Patched(pod, m);
  const json& server = out["spec"]["initContainers"][0];
  EXPECT_EQ(server["image"], "registry.example/s3-fuse:2.1");
  EXPECT_EQ(server["args"], json::array({"--socket=$(FUSEKEEPER_SOCKET)", "--bucket=models"}));
  EXPECT_EQ(server["resources"]["requests"]["cpu"], "250m");
  EXPECT_EQ(server["resources"]["limits"]["memory"], "1Gi");
  EXPECT_FALSE(server.contains("startupProbe")) << "another server: no fkserve probe";
  EXPECT_EQ(server["volumeMounts"][0]["name"], "sock");
  EXPECT_EQ(out["spec"]["volumes"].size(), 3u) << "the pod's own emptyDir is used, none added";
  bool socket_env = false;
  for (const auto& e : server["env"]) socket_env = socket_env || e["value"] == "/fusekeeper/s3.sock";
  EXPECT_TRUE(socket_env);
}

// Issue 19 item 4: an ordinary FUSE program in the user's own image runs under fkserve launch,
// which an init container copies from the fkserve image; the image needs nothing of ours.
TEST(PodMutationTest, AProgramInTheUsersOwnImageRunsUnderTheLauncherFromTheToolsVolume) {
  json pod = Recorded("inline_fuse_opt_in.json");
  auto& ann = pod["metadata"]["annotations"];
  ann["fusekeeper.csi/server-image"] = "registry.example/s3fs:1.90";
  ann["fusekeeper.csi/server-command"] = R"json(["s3fs", "models", "{mountpoint}", "-f", "-o", "url=https://s3.example"])json";
  const Mutation m = MutatePod(pod, Policy{}, ClaimInfo{});
  ASSERT_FALSE(m.denied.has_value()) << *m.denied;
  const json out = Patched(pod, m);
  // The tools first, then the server, then the pod's own init container.
  ASSERT_EQ(out["spec"]["initContainers"].size(), 3u);
  const json& tools = out["spec"]["initContainers"][0];
  EXPECT_EQ(tools["name"], "fusekeeper-tools");
  EXPECT_EQ(tools["image"], "fusekeeper/fkserve:0.1.0");
  EXPECT_FALSE(tools.contains("restartPolicy")) << "runs to completion before the server starts";
  EXPECT_EQ(tools["command"], json::array({"/usr/local/bin/fkserve", "install-tools", "/fusekeeper-tools"}));
  EXPECT_EQ(tools["securityContext"]["runAsNonRoot"], true);
  const json& server = out["spec"]["initContainers"][1];
  EXPECT_EQ(server["name"], "fusekeeper-server-data");
  EXPECT_EQ(server["image"], "registry.example/s3fs:1.90");
  EXPECT_EQ(server["command"], json::array({"/fusekeeper-tools/lib/ld-linux-x86-64.so.2", "--library-path",
                                            "/fusekeeper-tools/lib", "/fusekeeper-tools/fkserve"}));
  EXPECT_EQ(server["args"],
            json::array({"--socket=$(FUSEKEEPER_SOCKET)", "--ready_file=$(FUSEKEEPER_READY_FILE)",
                         "--fusermount=/fusekeeper-tools/fkserve-fusermount",
                         "--preload=/fusekeeper-tools/libfkserve_preload.so", "launch", "--", "s3fs", "models",
                         "{mountpoint}", "-f", "-o", "url=https://s3.example"}));
  bool tools_mounted = false;
  for (const auto& vm : server["volumeMounts"]) {
    tools_mounted = tools_mounted || (vm["name"] == "fusekeeper-tools" && vm["readOnly"] == true);
  }
  EXPECT_TRUE(tools_mounted);
  const json& probe = server["startupProbe"]["exec"]["command"];
  EXPECT_EQ(probe.back(), "ready");
  EXPECT_EQ(probe[3], "/fusekeeper-tools/fkserve");
  ASSERT_NE(Volume(out, "fusekeeper-tools"), nullptr);
  EXPECT_TRUE((*Volume(out, "fusekeeper-tools")).contains("emptyDir"));
  // Admitted again (reinvocation): nothing more is added.
  const Mutation again = MutatePod(out, Policy{}, ClaimInfo{});
  ASSERT_FALSE(again.denied.has_value());
  EXPECT_EQ(Patched(out, again)["spec"]["initContainers"].size(), 3u);
}

TEST(PodMutationTest, LongVolumeNamesGiveDistinctValidNames) {
  json pod = Recorded("inline_fuse_opt_in.json");
  const std::string a(60, 'a');
  const std::string b = std::string(59, 'a') + "b";
  json vol = pod["spec"]["volumes"][1];
  pod["spec"]["volumes"] = json::array();
  for (const std::string& n : {a, b}) {
    vol["name"] = n;
    pod["spec"]["volumes"].push_back(vol);
  }
  pod["spec"]["initContainers"] = json::array();
  const Mutation m = MutatePod(pod, Policy{}, ClaimInfo{});
  ASSERT_FALSE(m.denied.has_value()) << *m.denied;
  const json out = Patched(pod, m);
  std::set<std::string> names;
  for (const auto& c : out["spec"]["initContainers"]) {
    const std::string name = c["name"];
    EXPECT_LE(name.size(), 63u) << name;
    names.insert(name);
  }
  EXPECT_EQ(names.size(), 2u);
  std::set<std::string> volumes;
  for (const auto& v : out["spec"]["volumes"]) volumes.insert(v["name"].get<std::string>());
  EXPECT_EQ(volumes.size(), 4u) << "two FUSE volumes and two distinct socket emptyDirs";
}

TEST(PodMutationTest, JsonPointerTokensAreEscaped) {
  EXPECT_EQ(PointerToken("fusekeeper.csi/inject~server"), "fusekeeper.csi~1inject~0server");
}

}  // namespace
}  // namespace fusekeeper::webhook
