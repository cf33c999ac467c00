// The server pod's manifest: parsed back as JSON, it is bound, unprivileged, labelled, and named
// so that the same spec always has the same name and a changed one a new name.
#include "agent/serverpod/pod_manifest.h"

#include "gtest/gtest.h"
#include "simdjson.h"

namespace fusekeeper {
namespace {

state::ServerPod Spec(const std::string& image = "team/fs:1") {
  state::ServerPod s;
  s.set_image(image);
  s.add_args("--socket={socket}");
  s.add_args("serve");
  (*s.mutable_limits())["memory"] = "256Mi";
  (*s.mutable_requests())["cpu"] = "50m";
  return s;
}

ServerPodSettings Settings(const std::string& node = "node-a") {
  ServerPodSettings s;
  s.namespace_ = "fk-system";
  s.node = node;
  s.priority_class = "fusekeeper-server";
  return s;
}

std::string Get(simdjson::dom::element doc, const char* pointer) {
  std::string_view v;
  if (doc.at_pointer(pointer).get_string().get(v)) return "<absent>";
  return std::string(v);
}

TEST(PodManifestTest, ThePodIsBoundToItsNodeUnprivilegedAndReachesTheAgentThroughAnEmptyDir) {
  const ServerPodManifest m = BuildServerPod(Settings(), "vol-\"quoted\"", Spec(), 1000, 2000);
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_FALSE(parser.parse(m.json).get(doc)) << m.json;
  EXPECT_EQ(Get(doc, "/metadata/name"), m.name);
  EXPECT_EQ(Get(doc, "/metadata/namespace"), "fk-system");
  EXPECT_EQ(Get(doc, "/metadata/annotations/fusekeeper.io~1volume-id"), "vol-\"quoted\"");
  EXPECT_EQ(Get(doc, "/metadata/labels/fusekeeper.io~1node"), NodeLabelValue("node-a"));
  EXPECT_EQ(Get(doc, "/metadata/labels/fusekeeper.io~1server-spec"), m.spec_hash);
  EXPECT_EQ(Get(doc, "/spec/nodeName"), "node-a");
  EXPECT_EQ(Get(doc, "/spec/priorityClassName"), "fusekeeper-server");
  bool b = true;
  ASSERT_FALSE(doc.at_pointer("/spec/automountServiceAccountToken").get_bool().get(b));
  EXPECT_FALSE(b);
  ASSERT_FALSE(doc.at_pointer("/spec/securityContext/runAsNonRoot").get_bool().get(b));
  EXPECT_TRUE(b);
  int64_t uid = 0, gid = 0;
  ASSERT_FALSE(doc.at_pointer("/spec/securityContext/runAsUser").get_int64().get(uid));
  ASSERT_FALSE(doc.at_pointer("/spec/securityContext/runAsGroup").get_int64().get(gid));
  EXPECT_EQ(uid, 1000);
  EXPECT_EQ(gid, 2000);
  EXPECT_EQ(Get(doc, "/spec/containers/0/image"), "team/fs:1");
  EXPECT_EQ(Get(doc, "/spec/containers/0/args/0"), "--socket=/run/fusekeeper/handoff.sock");
  EXPECT_EQ(Get(doc, "/spec/containers/0/securityContext/capabilities/drop/0"), "ALL");
  ASSERT_FALSE(doc.at_pointer("/spec/containers/0/securityContext/allowPrivilegeEscalation").get_bool().get(b));
  EXPECT_FALSE(b);
  ASSERT_FALSE(doc.at_pointer("/spec/containers/0/securityContext/readOnlyRootFilesystem").get_bool().get(b));
  EXPECT_TRUE(b);
  // Requests are always explicit: the volume's cpu, the agent's default memory.
  EXPECT_EQ(Get(doc, "/spec/containers/0/resources/requests/cpu"), "50m");
  EXPECT_EQ(Get(doc, "/spec/containers/0/resources/requests/memory"), "32Mi");
  EXPECT_EQ(Get(doc, "/spec/containers/0/resources/limits/memory"), "256Mi");
  EXPECT_EQ(Get(doc, "/spec/volumes/0/name"), kHandoffVolume);
  simdjson::dom::element e;
  EXPECT_FALSE(doc.at_pointer("/spec/volumes/0/emptyDir").get(e));
  EXPECT_TRUE(doc.at_pointer("/spec/volumes/0/hostPath").get(e)) << "no host paths";
  EXPECT_TRUE(doc.at_pointer("/spec/hostNetwork").get(e));
  EXPECT_TRUE(doc.at_pointer("/spec/containers/0/command").get(e)) << "no command: the image's entrypoint";
}

TEST(PodManifestTest, TheNameFollowsVolumeNodeAndSpecAndIsAValidName) {
  const auto a = BuildServerPod(Settings(), "vol-1", Spec(), 1000, 1000);
  EXPECT_EQ(a.name, BuildServerPod(Settings(), "vol-1", Spec(), 1000, 1000).name);
  EXPECT_NE(a.name, BuildServerPod(Settings(), "vol-2", Spec(), 1000, 1000).name);
  EXPECT_NE(a.name, BuildServerPod(Settings("node-b"), "vol-1", Spec(), 1000, 1000).name);
  const auto rolled = BuildServerPod(Settings(), "vol-1", Spec("team/fs:2"), 1000, 1000);
  EXPECT_NE(a.name, rolled.name);
  EXPECT_NE(a.spec_hash, rolled.spec_hash);
  EXPECT_NE(a.name, BuildServerPod(Settings(), "vol-1", Spec(), 1001, 1000).name);
  // A DNS label: lower case, digits and '-', at most 63 characters.
  EXPECT_LE(a.name.size(), 63u);
  for (char c : a.name) EXPECT_TRUE((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-') << a.name;
}

TEST(PodManifestTest, TheSeccompProfileIsTheAgentsChoice) {
  ServerPodSettings s = Settings();
  simdjson::dom::parser parser;
  EXPECT_EQ(Get(parser.parse(BuildServerPod(s, "v", Spec(), 1, 1).json), "/spec/securityContext/seccompProfile/type"),
            "RuntimeDefault");
  s.seccomp_profile = "Localhost/profiles/fk-io-uring.json";
  simdjson::dom::element doc = parser.parse(BuildServerPod(s, "v", Spec(), 1, 1).json);
  EXPECT_EQ(Get(doc, "/spec/securityContext/seccompProfile/type"), "Localhost");
  EXPECT_EQ(Get(doc, "/spec/securityContext/seccompProfile/localhostProfile"), "profiles/fk-io-uring.json");
  EXPECT_EQ(SeccompProfileProblem("Unconfined"), "");
  EXPECT_NE(SeccompProfileProblem("runtime/default"), "");
  EXPECT_NE(SeccompProfileProblem("Localhost/"), "");
}

TEST(PodManifestTest, TheNodeSelectorNamesTheNodesLabel) {
  EXPECT_EQ(NodeSelector(Settings()),
            "app.kubernetes.io/managed-by=fusekeeper,fusekeeper.io/node=" + NodeLabelValue("node-a"));
}

// An agent upgrade must find the server pods the earlier agent made: the same spec gives the same
// manifest, byte for byte (its hash names the pod), or every server pod would be rolled.
TEST(PodManifestTest, TheManifestOfASpecDoesNotChangeAcrossAgentVersions) {
  state::ServerPod spec = Spec();
  spec.add_command("/bin/fs");
  spec.add_command("--at={socket}");
  ServerPodSettings settings = Settings();
  settings.seccomp_profile = "Localhost/profiles/fk.json";
  const ServerPodManifest m = BuildServerPod(settings, "pv-1", spec, 1000, 2000, /*successor=*/true);
  EXPECT_EQ(m.name, "fk-57c401c9dec61f8d-66570ff0-e0e9b9730a-2");
  EXPECT_EQ(m.json, R"({"apiVersion":"v1","kind":"Pod","metadata":{"name":"fk-57c401c9dec61f8d-66570ff0-e0e9b9730a-2",)"
                    R"("namespace":"fk-system","labels":{"app.kubernetes.io/managed-by":"fusekeeper",)"
                    R"("app.kubernetes.io/component":"fuse-server","fusekeeper.io/node":"66570ff05a207404",)"
                    R"("fusekeeper.io/volume":"57c401c9dec61f8dc6e838ec38e4c348","fusekeeper.io/server-spec":"e0e9b9730a"},)"
                    R"("annotations":{"fusekeeper.io/volume-id":"pv-1","fusekeeper.io/node-name":"node-a"}},)"
                    R"("spec":{"nodeName":"node-a","restartPolicy":"Always","automountServiceAccountToken":false,)"
                    R"("enableServiceLinks":false,"terminationGracePeriodSeconds":30,"tolerations":[{"operator":"Exists"}],)"
                    R"("priorityClassName":"fusekeeper-server","securityContext":{"runAsNonRoot":true,"runAsUser":1000,)"
                    R"("runAsGroup":2000,"seccompProfile":{"type":"Localhost","localhostProfile":"profiles/fk.json"}},)"
                    R"("containers":[{"name":"server","image":"team/fs:1","imagePullPolicy":"IfNotPresent",)"
                    R"("command":["/bin/fs","--at=/run/fusekeeper/handoff.sock"],)"
                    R"("args":["--socket=/run/fusekeeper/handoff.sock","serve"],)"
                    R"("env":[{"name":"FUSEKEEPER_SOCKET","value":"/run/fusekeeper/handoff.sock"}],)"
                    R"("resources":{"requests":{"cpu":"50m","memory":"32Mi"},"limits":{"memory":"256Mi"}},)"
                    R"("securityContext":{"allowPrivilegeEscalation":false,"privileged":false,)"
                    R"("readOnlyRootFilesystem":true,"capabilities":{"drop":["ALL"]}},)"
                    R"("volumeMounts":[{"name":"fusekeeper-handoff","mountPath":"/run/fusekeeper"}]}],)"
                    R"("volumes":[{"name":"fusekeeper-handoff","emptyDir":{"sizeLimit":"1Mi"}}]}})");
}

}  // namespace
}  // namespace fusekeeper
