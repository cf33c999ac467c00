// The webhook's output, run: a pod with one inline FUSE volume and the opt-in annotation goes
// through MutatePod, and the patched pod is then played the way kubelet and the container
// runtime would play it: the volume published by the real agent with the patched volumeAttributes,
// the injected sidecar's command run from its args and env ($(VAR) expanded, /fusekeeper mapped to
// the pod's emptyDir) as its securityContext's user, its startupProbe run until it passes, the app
// container's view read as a container with HostToContainer would, and the sidecar restarted after
// a crash, as kubelet restarts native sidecars.
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "agent/webhook/pod_mutation.h"
#include "nlohmann/json.hpp"
#include "tests/volume/fuse_fixture.h"
#include "tests/webhook/recorded_pods.h"

namespace fusekeeper {
namespace {

using json = nlohmann::json;
using namespace csi::v1;

class InjectedPodTest : public FuseE2ETest {
 protected:
  // The pod as its author wrote it, with the sidecar serving this test's export.
  json AuthoredPod() {
    json pod = RecordedPod("inline_fuse_opt_in.json");
    pod["spec"]["volumes"][1]["csi"]["volumeAttributes"]["serverUid"] = std::to_string(kServerUid);
    pod["metadata"]["annotations"]["fusekeeper.csi/server-args"] =
        json::array({"--socket=$(FUSEKEEPER_SOCKET)", "--ready_file=$(FUSEKEEPER_READY_FILE)", "serve",
                     "--root=" + export_})
            .dump();
    return pod;
  }
  // The injected container's command line as the runtime runs it: $(VAR) from its env, and paths
  // under its volume mounts mapped to where those volumes are on this node.
  std::vector<std::string> CommandOf(const json& container, const std::vector<std::string>& args,
                                     const std::string& socket_dir_on_node, const std::string& tools_on_node = "") {
    std::vector<std::pair<std::string, std::string>> vars;
    for (const auto& e : container.value("env", json::array())) {
      vars.emplace_back("$(" + e["name"].get<std::string>() + ")", e["value"].get<std::string>());
    }
    std::vector<std::string> out;
    for (std::string a : args) {
      for (const auto& [k, v] : vars) a = absl::StrReplaceAll(a, {{k, v}});
      a = a == webhook::kToolsDir ? tools_on_node
                                  : absl::StrReplaceAll(a, {{std::string(webhook::kToolsDir) + "/", tools_on_node + "/"}});
      out.push_back(absl::StrReplaceAll(a, {{std::string(webhook::kSocketDir) + "/", socket_dir_on_node + "/"}}));
    }
    return out;
  }
  Subprocess* RunSidecar(const json& server, const std::string& socket_dir_on_node) {
    const uid_t uid = server["securityContext"]["runAsUser"];
    const gid_t gid = server["securityContext"]["runAsGroup"];
    std::vector<std::string> cmd = {fkserve_};
    for (const auto& a : CommandOf(server, server["args"].get<std::vector<std::string>>(), socket_dir_on_node)) {
      cmd.push_back(a);
    }
    servers_.push_back(std::make_unique<Subprocess>(cmd, std::vector<std::string>{}, [uid, gid] {
      if (setresgid(gid, gid, gid) != 0 || setresuid(uid, uid, uid) != 0) _exit(99);
    }));
    return servers_.back().get();
  }
  // kubelet for the patched pod's inline volume: the pod's emptyDirs, then NodePublishVolume with
  // the patched volumeAttributes. Sets the socket emptyDir's and the target's paths on the node.
  void PublishAsKubelet(const json& pod, const std::string& uid, const std::string& volume_id, std::string* empty_dir,
                        std::string* target) {
    const json& attrs = pod["spec"]["volumes"][1]["csi"]["volumeAttributes"];
    *empty_dir = kubelet_ + "/pods/" + uid + "/volumes/kubernetes.io~empty-dir/" +
                 attrs["socketVolume"].get<std::string>();
    fs::create_directories(*empty_dir);
    chmod(empty_dir->c_str(), 0777);  // as kubelet makes emptyDirs
    fs::create_directories(kubelet_ + "/pods/" + uid + "/volumes/kubernetes.io~csi/data");
    *target = kubelet_ + "/pods/" + uid + "/volumes/kubernetes.io~csi/data/mount";
    NodePublishVolumeRequest r;
    r.set_volume_id(volume_id);
    r.set_target_path(*target);
    *r.mutable_volume_capability() = MountCapability();
    for (const auto& [k, v] : attrs.items()) (*r.mutable_volume_context())[k] = v.get<std::string>();
    (*r.mutable_volume_context())["csi.storage.k8s.io/pod.uid"] = uid;
    (*r.mutable_volume_context())["csi.storage.k8s.io/ephemeral"] = "true";
    NodePublishVolumeResponse resp;
    auto c = Ctx();
    grpc::Status published = node_->NodePublishVolume(c.get(), r, &resp);
    ASSERT_TRUE(published.ok()) << published.error_message() << agent_->Stderr();
  }
  // Runs the sidecar's startupProbe until it passes (as kubelet does, periodSeconds apart; here
  // back to back, bounded by the test deadline).
  bool StartupProbePasses(const json& server, const std::string& socket_dir_on_node) {
    std::vector<std::string> probe = server["startupProbe"]["exec"]["command"];
    probe = CommandOf(server, probe, socket_dir_on_node);
    probe[0] = fkserve_;  // the image's /usr/local/bin/fkserve is this test's copy
    const auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
    while (std::chrono::steady_clock::now() < deadline) {
      Subprocess p(probe);
      if (p.Wait(std::chrono::seconds(20)).value_or(-1) == 0) return true;
    }
    return false;
  }
};

TEST_F(InjectedPodTest, AnOptedInPodIsServedByItsInjectedSidecarAndSurvivesItsCrash) {
  StartAgent();
  const json authored = AuthoredPod();
  const webhook::Mutation m = webhook::MutatePod(authored, webhook::Policy{}, webhook::ClaimInfo{});
  ASSERT_FALSE(m.denied.has_value()) << *m.denied;
  const json pod = authored.patch(m.patch);

  // kubelet: the pod's emptyDirs, then NodePublishVolume with the patched volumeAttributes.
  std::string empty_dir, target;
  ASSERT_NO_FATAL_FAILURE(PublishAsKubelet(pod, "injected-pod-uid", "csi-injected-1", &empty_dir, &target));

  // The runtime: the injected native sidecar first, the app once its startupProbe passes. The
  // sidecar sees the emptyDir at /fusekeeper; here at a short path that leads there (the node's
  // path is too long for a socket address, the container's is not).
  const json& server = pod["spec"]["initContainers"][0];
  ASSERT_EQ(server["restartPolicy"], "Always");
  char seen_as[] = "/tmp/fkc-XXXXXX";
  ASSERT_NE(mkdtemp(seen_as), nullptr);
  chmod(seen_as, 0755);
  const std::string in_container = std::string(seen_as) + "/fusekeeper";
  fs::create_directory_symlink(empty_dir, in_container);
  Subprocess* sidecar = RunSidecar(server, in_container);
  ASSERT_TRUE(StartupProbePasses(server, in_container)) << sidecar->Stderr() << agent_->Stderr();
  // The app's volumeMount got HostToContainer: it reads through a container-like view.
  ASSERT_EQ(pod["spec"]["containers"][0]["volumeMounts"][0]["mountPropagation"], "HostToContainer");
  auto app = PodReader(target, "hello.txt");
  ASSERT_TRUE(app->WaitForReadsOf("hello from the export\n")) << app->setup_error() << sidecar->Stderr();

  // The sidecar crashes; kubelet restarts it (same spec); the app keeps reading.
  sidecar->Signal(SIGKILL);
  ASSERT_TRUE(sidecar->Wait(std::chrono::seconds(20)).has_value());
  Subprocess* restarted = RunSidecar(server, in_container);
  ASSERT_TRUE(app->WaitForReadsOf("hello from the export\n")) << restarted->Stderr() << agent_->Stderr();
  app->Stop();
  ASSERT_RPC_OK(Unpublish("csi-injected-1", target));
  fs::remove_all(seen_as);
}

// Issue 19 item 4: the pod names an ordinary FUSE program in its own image (bindfs here: this
// machine plays that image) and nothing of ours. The webhook's init container copies the
// launcher out of the fkserve image; the sidecar runs the program under it, through the copied
// loader; the app reads from its container's view; the program crashes and is restarted.
TEST_F(InjectedPodTest, AProgramInTheUsersOwnImageIsServedThroughTheCopiedLauncher) {
  if (access("/usr/bin/bindfs", X_OK) != 0) GTEST_SKIP() << "bindfs is not installed (scripts/setup.sh installs it)";
  StartAgent();
  json authored = RecordedPod("inline_fuse_opt_in.json");
  authored["spec"]["volumes"][1]["csi"]["volumeAttributes"]["serverUid"] = std::to_string(kServerUid);
  authored["metadata"]["annotations"]["fusekeeper.csi/server-image"] = "registry.example/bindfs:1.14";
  authored["metadata"]["annotations"]["fusekeeper.csi/server-command"] =
      json::array({"bindfs", "-f", export_, "{mountpoint}"}).dump();
  const webhook::Mutation m = webhook::MutatePod(authored, webhook::Policy{}, webhook::ClaimInfo{});
  ASSERT_FALSE(m.denied.has_value()) << *m.denied;
  const json pod = authored.patch(m.patch);
  std::string empty_dir, target;
  ASSERT_NO_FATAL_FAILURE(PublishAsKubelet(pod, "tools-pod-uid", "csi-tools-1", &empty_dir, &target));
  // The runtime: the tools init container (the fkserve image: this test's copy of fkserve, with
  // its fusermount and preload library beside it) into the pod's tools emptyDir.
  const json& tools = pod["spec"]["initContainers"][0];
  ASSERT_EQ(tools["name"], webhook::kToolsContainer);
  char seen_as[] = "/tmp/fkt-XXXXXX";
  ASSERT_NE(mkdtemp(seen_as), nullptr);
  chmod(seen_as, 0755);
  const std::string tools_dir = std::string(seen_as) + "/tools";
  fs::create_directories(tools_dir);
  chown(tools_dir.c_str(), kServerUid, kServerUid);
  std::vector<std::string> install = CommandOf(tools, tools["command"].get<std::vector<std::string>>(), "", tools_dir);
  ASSERT_EQ(install[0], "/usr/local/bin/fkserve");
  install[0] = fkserve_;
  Subprocess installer(install, {}, [] {
    if (setresgid(kServerUid, kServerUid, kServerUid) != 0 || setresuid(kServerUid, kServerUid, kServerUid) != 0) {
      _exit(99);
    }
  });
  ASSERT_EQ(installer.Wait(std::chrono::seconds(20)).value_or(-1), 0) << installer.Stderr();
  // The sidecar: the user's image (this machine), the launcher from the tools volume.
  const json& server = pod["spec"]["initContainers"][1];
  const std::string in_container = std::string(seen_as) + "/fusekeeper";
  fs::create_directory_symlink(empty_dir, in_container);
  auto run_sidecar = [&] {
    std::vector<std::string> cmd = CommandOf(server, server["command"].get<std::vector<std::string>>(), in_container,
                                             tools_dir);
    for (const auto& a : CommandOf(server, server["args"].get<std::vector<std::string>>(), in_container, tools_dir)) {
      cmd.push_back(a);
    }
    servers_.push_back(std::make_unique<Subprocess>(cmd, std::vector<std::string>{}, [] {
      if (setresgid(kServerUid, kServerUid, kServerUid) != 0 || setresuid(kServerUid, kServerUid, kServerUid) != 0) {
        _exit(99);
      }
    }));
    return servers_.back().get();
  };
  Subprocess* sidecar = run_sidecar();
  std::vector<std::string> probe =
      CommandOf(server, server["startupProbe"]["exec"]["command"].get<std::vector<std::string>>(), in_container,
                tools_dir);
  bool ready = false;
  const auto deadline = std::chrono::steady_clock::now() + kTestDeadline;
  while (!ready && std::chrono::steady_clock::now() < deadline) {
    Subprocess p(probe);
    ready = p.Wait(std::chrono::seconds(20)).value_or(-1) == 0;
  }
  ASSERT_TRUE(ready) << sidecar->Stderr() << agent_->Stderr();
  auto app = PodReader(target, "hello.txt");
  ASSERT_TRUE(app->WaitForReadsOf("hello from the export\n")) << app->setup_error() << sidecar->Stderr();
  EXPECT_TRUE(absl::StrContains(sidecar->Stderr(), "handed the volume's FUSE connection over")) << sidecar->Stderr();
  // The sidecar crashes; kubelet restarts it; the app reads again.
  sidecar->Signal(SIGKILL);
  ASSERT_TRUE(sidecar->Wait(std::chrono::seconds(20)).has_value());
  // (its program, which the launcher ran, goes with the volume's connection being replaced)
  Subprocess* restarted = run_sidecar();
  ASSERT_TRUE(app->WaitForReadsOf("hello from the export\n")) << restarted->Stderr() << agent_->Stderr();
  app->Stop();
  ASSERT_RPC_OK(Unpublish("csi-tools-1", target));
}

}  // namespace
}  // namespace fusekeeper
