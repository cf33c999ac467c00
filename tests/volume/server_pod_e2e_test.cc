// Server pods end to end: the real agent against the API-server double (real HTTPS), real FUSE
// mounts in a private mount namespace, readers in container-like pod views. The test plays the
// kubelet: for each pod the agent creates it makes the pod's emptyDir under the kubelet dir and
// runs the pod's declared command (fkserve, unprivileged) with {socket} mapped to it.
#include <sys/stat.h>

#include <functional>
#include <iostream>

#include "absl/strings/str_join.h"
#include "simdjson.h"
#include "tests/volume/fuse_fixture.h"
#include "tests/volume/pod_workload.h"

namespace fusekeeper {
namespace {

class ServerPodE2ETest : public FuseE2ETest {
 protected:
  // A PV's volumeAttributes that declare the server.
  std::map<std::string, std::string> ServerContext(const std::string& image = "example.com/fkserve:1.0") {
    return {{"kind", "fuse"},
            {"serverUid", std::to_string(kServerUid)},
            {"serverImage", image},
            {"serverArgs", R"(["--socket={socket}", "serve", "--root=)" + export_ + R"("])"},
            {"serverResources", R"({"requests": {"memory": "48Mi"}, "limits": {"memory": "128Mi"}})"}};
  }
  // The staging path of `id`, made once (after NodeStage it is a FUSE mount: no stat of it here
  // may wait on a server that is not there).
  std::string Staging(const std::string& id) {
    auto it = staging_.find(id);
    if (it == staging_.end()) it = staging_.emplace(id, StagingPath(id)).first;
    return it->second;
  }
  grpc::Status Stage(const std::string& id, const std::map<std::string, std::string>& ctx) {
    NodeStageVolumeRequest r;
    r.set_volume_id(id);
    r.set_staging_target_path(Staging(id));
    *r.mutable_volume_capability() = MountCapability();
    for (const auto& [k, v] : ctx) (*r.mutable_volume_context())[k] = v;
    NodeStageVolumeResponse resp;
    auto c = Ctx();
    return node_->NodeStageVolume(c.get(), r, &resp);
  }
  void StartAgentInCluster(std::vector<std::string> extra = {}) {
    StartKube();
    RestartAgent(std::move(extra));
  }

  struct PodSeen {
    std::string name, uid, image, node;
    std::vector<std::string> args;
    std::string json;
  };
  // The double's pods, as the agent made them.
  std::vector<PodSeen> Pods() {
    std::vector<PodSeen> out;
    const std::string json = kube_->PodStore();
    simdjson::dom::parser parser;
    simdjson::dom::element doc;
    if (parser.parse(json).get(doc)) return out;
    simdjson::dom::object obj;
    if (doc.get_object().get(obj)) return out;
    auto str = [](simdjson::dom::element e, const char* ptr) {
      std::string_view v;
      return e.at_pointer(ptr).get_string().get(v) ? std::string() : std::string(v);
    };
    for (auto [key, pod] : obj) {
      PodSeen p;
      p.name = str(pod, "/metadata/name");
      p.uid = str(pod, "/metadata/uid");
      p.image = str(pod, "/spec/containers/0/image");
      p.node = str(pod, "/spec/nodeName");
      simdjson::dom::array args;
      if (!pod.at_pointer("/spec/containers/0/args").get_array().get(args)) {
        for (simdjson::dom::element a : args) p.args.push_back(std::string(a.get_string().value()));
      }
      p.json = simdjson::to_string(pod);
      out.push_back(std::move(p));
    }
    return out;
  }
  // Waits (on the double's request log, no sleeping) until `pred(Pods())`.
  template <typename Pred>
  bool WaitPods(Pred pred) {
    return kube_->WaitUntil([&] { return pred(Pods()); });
  }
  // The kubelet's part: the pod's emptyDir, and its container, run as declared.
  Subprocess* RunPod(const PodSeen& pod) {
    const std::string real = kubelet_ + "/pods/" + pod.uid + "/volumes/kubernetes.io~empty-dir/fusekeeper-handoff";
    fs::create_directories(real);
    chmod(real.c_str(), 0777);
    // The pod reaches it as /run/fusekeeper; here a short link to it keeps the socket's path
    // within sun_path's 108 bytes.
    const std::string dir = root_.path() + "/p" + std::to_string(pods_run_++);
    fs::create_directory_symlink(real, dir);
    std::vector<std::string> cmd = {fkserve_};
    for (std::string a : pod.args) {
      // The pod sees its emptyDir at /run/fusekeeper; this test's "container" sees the host path.
      const std::string in_pod = "/run/fusekeeper/";
      if (size_t at = a.find(in_pod); at != std::string::npos) a.replace(at, in_pod.size(), dir + "/");
      cmd.push_back(a);
    }
    servers_.push_back(std::make_unique<Subprocess>(cmd, std::vector<std::string>{}, [] {
      if (setresgid(kServerUid, kServerUid, kServerUid) != 0 || setresuid(kServerUid, kServerUid, kServerUid) != 0) {
        _exit(99);
      }
    }));
    return servers_.back().get();
  }

  // Volume `id` staged with its declared server, the pod's server running, published into pod
  // "app-1" and read there.
  struct Served {
    PodSeen pod;
    Subprocess* server = nullptr;
    std::string target;
    std::unique_ptr<Reader> reader;
  };
  Served StageServeAndRead(const std::string& id) {
    Served out;
    grpc::Status s = Stage(id, ServerContext());
    EXPECT_TRUE(s.ok()) << s.error_message() << agent_->Stderr();
    auto pods = Pods();
    EXPECT_EQ(pods.size(), 1u) << kube_->PodStore();
    if (pods.empty()) return out;
    out.pod = pods[0];
    out.server = RunPod(out.pod);
    out.target = Pod("app-1", id);
    EXPECT_TRUE(PublishStaged(id, Staging(id), out.target, "app-1", "app-1").ok());
    out.reader = PodReader(out.target, "hello.txt");
    EXPECT_TRUE(out.reader->WaitForReadsOf("hello from the export\n"))
        << out.reader->setup_error() << out.server->Stderr() << agent_->Stderr();
    return out;
  }
  void KillAgent() {
    agent_->Signal(SIGKILL);
    ASSERT_TRUE(agent_->Wait(std::chrono::milliseconds(20000)).has_value());
  }
  void RestartAgent(std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {"--kube_secrets_dir=" + secrets_, "--server_namespace=fk-system",
                                      "--server_pod_resync_ms=100", "--server_gone_grace_ms=60000"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    StartAgent(flags);
  }
  // kubectl annotate pv <pv> fusekeeper.io/server-image=<image>, as the double answers PV lists.
  void AnnotatePv(const std::string& handle, const std::string& image) {
    kube_->SetObjects({{"/api/v1/persistentvolumes",
                        R"({"kind":"PersistentVolumeList","items":[{"metadata":{"name":"pv","annotations":)"
                        R"({"fusekeeper.io/server-image":")" + image + R"("}},"spec":{"csi":)"
                        R"({"driver":"fusekeeper.csi","volumeHandle":")" + handle + R"("}}}]})"}});
  }
  // The pod the agent made beside `old` (a roll).
  PodSeen OtherPod(const PodSeen& old) {
    for (const auto& p : Pods()) {
      if (p.uid != old.uid) return p;
    }
    return {};
  }
  // kubectl delete of `pod` (the object goes at once) and the kubelet's SIGTERM to its
  // `server`: the server drains (the test's `drains`-th drain), the agent makes the pod again,
  // `while_draining` checks that the volume is still served, the "kubelet" starts the new pod's
  // server, and the old one stops once that one waits. Returns the new pod and its server (null
  // after a failure).
  std::pair<PodSeen, Subprocess*> DeleteAndDrain(const PodSeen& pod, Subprocess* server, int drains,
                                                 const std::function<void()>& while_draining) {
    EXPECT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + pod.name), 200);
    server->Signal(SIGTERM);
    if (!agent_->WaitForStderr("was asked to stop and serves on", drains, kTestDeadline) ||
        !WaitPods([&](const auto& p) { return p.size() == 1 && p[0].uid != pod.uid; })) {
      ADD_FAILURE() << "no drain, or no new pod\n" << kube_->PodStore() << server->Stderr() << agent_->Stderr();
      return {};
    }
    const PodSeen next = Pods().at(0);
    while_draining();
    EXPECT_FALSE(server->Wait(std::chrono::milliseconds(0)).has_value()) << "it waits for its successor";
    Subprocess* next_server = RunPod(next);
    if (!server->Wait(std::chrono::milliseconds(20000)).has_value()) {
      ADD_FAILURE() << "the draining server did not stop\n" << server->Stderr() << agent_->Stderr();
      return {};
    }
    EXPECT_TRUE(absl::StrContains(server->Stderr(), "stopping: the agent's successor server waits")) << server->Stderr();
    // Its relay stopped at once, not at the bound of a loop that could not finish stopping.
    EXPECT_FALSE(absl::StrContains(server->Stderr(), "did not finish cancelling")) << server->Stderr();
    return {next, next_server};
  }

  std::map<std::string, std::string> staging_;
  int pods_run_ = 0;
};

TEST_F(ServerPodE2ETest, StageMakesTheServerPodItsServerServesEveryPodAndUnstageDeletesIt) {
  StartAgentInCluster();
  const std::string id = "pv-shared";
  grpc::Status s = Stage(id, ServerContext());
  ASSERT_TRUE(s.ok()) << s.error_message() << agent_->Stderr();
  auto pods = Pods();
  ASSERT_EQ(pods.size(), 1u) << kube_->PodStore();
  const PodSeen pod = pods[0];
  EXPECT_EQ(pod.image, "example.com/fkserve:1.0");
  EXPECT_EQ(pod.node, "n");
  ASSERT_EQ(pod.args.size(), 3u);
  EXPECT_EQ(pod.args[0], "--socket=/run/fusekeeper/handoff.sock");
  EXPECT_TRUE(absl::StrContains(pod.json, R"("limits":{"memory":"128Mi"})")) << pod.json;
  EXPECT_TRUE(absl::StrContains(pod.json, R"("cpu":"10m")")) << "the agent's default request: " << pod.json;
  EXPECT_TRUE(absl::StrContains(pod.json, R"("runAsUser":)" + std::to_string(kServerUid))) << pod.json;

  Subprocess* server = RunPod(pod);
  const std::string t1 = Pod("app-1", id), t2 = Pod("app-2", id);
  ASSERT_TRUE(PublishStaged(id, Staging(id), t1, "app-1", "app-1").ok());
  ASSERT_TRUE(PublishStaged(id, Staging(id), t2, "app-2", "app-2").ok());
  auto r1 = PodReader(t1, "hello.txt");
  auto r2 = PodReader(t2, "hello.txt");
  ASSERT_TRUE(r1->WaitForReadsOf("hello from the export\n")) << r1->setup_error() << server->Stderr()
                                                             << agent_->Stderr();
  ASSERT_TRUE(r2->WaitForReadsOf("hello from the export\n")) << r2->setup_error();
  EXPECT_EQ(r1->errors() + r2->errors(), 0);
  r1.reset();
  r2.reset();

  ASSERT_TRUE(Unpublish(id, t1).ok());
  ASSERT_TRUE(Unpublish(id, t2).ok());
  s = Unstage(id, Staging(id));
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitPods([](const auto& p) { return p.empty(); })) << kube_->PodStore();
  EXPECT_EQ(MountCountAt(Staging(id)), 0);
}

TEST_F(ServerPodE2ETest, ADeletedServerPodIsMadeAgainAndItsServerTakesOverWithoutAnError) {
  StartAgentInCluster();
  Served v = StageServeAndRead("pv-deleted");
  ASSERT_NE(v.server, nullptr);
  auto& r = v.reader;
  // kubectl delete pod: the API server forgets it, the kubelet stops its container. Its server
  // drains: it serves on while the pod is made again and stops once the new server waits.
  auto [second, next] = DeleteAndDrain(v.pod, v.server, 1, [&] {
    r->Mark();
    EXPECT_TRUE(r->WaitForReadsOf("hello from the export\n")) << "the draining server still serves";
  });
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(second.name, v.pod.name) << "the same pod, made again";
  ASSERT_TRUE(agent_->WaitForStderr("on standby from " + second.uid + " takes over", 1, kTestDeadline))
      << agent_->Stderr();
  r->Mark();
  ASSERT_TRUE(r->WaitForReadsOf("hello from the export\n")) << next->Stderr() << agent_->Stderr();
  EXPECT_EQ(r->errors(), 0) << "no read failed";
  EXPECT_EQ(agent_->CountInStderr("fresh FUSE connection mounted"), 0) << agent_->Stderr();
  EXPECT_TRUE(agent_->WaitForStderr("ServerPodRecreated", 1, kTestDeadline));
}

// A server asked to stop while nothing replaces it (its container stopped, the pod kept) stops
// at the end of its drain time: draining never keeps a server past what the agent allowed.
TEST_F(ServerPodE2ETest, ADrainingServerWithoutASuccessorStopsAtItsDeadline) {
  StartAgentInCluster({"--server_drain_ms=300", "--server_grace_period_s=2"});
  Served v = StageServeAndRead("pv-drain-deadline");
  ASSERT_NE(v.server, nullptr);
  v.server->Signal(SIGTERM);
  ASSERT_TRUE(v.server->Wait(std::chrono::milliseconds(20000)).has_value());
  EXPECT_TRUE(absl::StrContains(v.server->Stderr(), "at most 300 ms")) << v.server->Stderr();
  EXPECT_TRUE(absl::StrContains(v.server->Stderr(), "no successor came within the drain time")) << v.server->Stderr();
  EXPECT_TRUE(agent_->WaitForStderr("ServerDraining", 1, kTestDeadline)) << agent_->Stderr();
  // The kubelet restarts the container in the same pod: its server takes the connection over.
  auto& r = v.reader;
  r->Mark();
  Subprocess* again = RunPod(v.pod);
  ASSERT_TRUE(r->WaitForReadsOf("hello from the export\n")) << again->Stderr() << agent_->Stderr();
  EXPECT_EQ(r->errors(), 0);
}

// Other people's programs behind server pods: Debian's bindfs, unmodified, through `fkserve
// launch` (relayed), its pod deleted three times under an app holding files open (pod_workload.h:
// a sequential reader, an mmap, a listing in progress, its cwd inside, an O_APPEND log and a
// rewritten block, each fsynced). Each time the draining launcher relays on until the successor's
// launcher waits, which carries on from the relay state: no operation fails, no fresh connection,
// and what was written reads back byte for byte.
TEST_F(ServerPodE2ETest, AnUnmodifiedProgramsPodDeletedUnderOpenFilesDrainsWithoutAnError) {
  if (access("/usr/bin/bindfs", X_OK) != 0) GTEST_SKIP() << "/usr/bin/bindfs is not installed (scripts/setup.sh installs it)";
  StartAgentInCluster();
  const std::string src = root_.path() + "/bindfs-src";
  fs::create_directories(src);
  PodWorkload::CreateFiles(src);
  ASSERT_EQ(lchown(src.c_str(), kServerUid, kServerUid), 0);
  for (const auto& e : fs::recursive_directory_iterator(src)) {
    ASSERT_EQ(lchown(e.path().c_str(), kServerUid, kServerUid), 0) << e.path();
  }
  auto ctx = ServerContext();
  ctx["serverArgs"] = R"(["--socket={socket}", "launch", "--", "/usr/bin/bindfs", "-f", ")" + src + R"(", "{mountpoint}"])";
  ASSERT_TRUE(Stage("pv-bindfs", ctx).ok()) << agent_->Stderr();
  auto pods = Pods();
  ASSERT_EQ(pods.size(), 1u) << kube_->PodStore();
  PodSeen pod = pods[0];
  Subprocess* server = RunPod(pod);
  const std::string target = Pod("app-1", "pv-bindfs");
  ASSERT_TRUE(PublishStaged("pv-bindfs", Staging("pv-bindfs"), target, "app-1", "app-1").ok());
  const std::string view = root_.path() + "/views/app-1";
  fs::create_directories(view);
  PodWorkload app(target, view, /*writable=*/true, kServerUid);
  ASSERT_TRUE(app.WaitForSteps(3)) << absl::StrJoin(app.errors(), "; ") << server->Stderr() << agent_->Stderr();
  constexpr int kDeletes = 3;
  for (int i = 1; i <= kDeletes; ++i) {
    auto [next_pod, next] = DeleteAndDrain(pod, server, i, [&] {
      EXPECT_TRUE(app.WaitForSteps(2)) << "the draining launcher still serves: " << absl::StrJoin(app.errors(), "; ");
    });
    ASSERT_NE(next, nullptr) << "delete " << i;
    ASSERT_TRUE(app.WaitForSteps(2)) << "delete " << i << ": " << absl::StrJoin(app.errors(), "; ") << next->Stderr()
                                     << agent_->Stderr();
    pod = next_pod;
    server = next;
  }
  EXPECT_TRUE(app.Finish()) << absl::StrJoin(app.errors(), "; ");
  EXPECT_EQ(app.errors().size(), 0u) << absl::StrJoin(app.errors(), "; ");
  EXPECT_EQ(agent_->CountInStderr("fresh FUSE connection mounted"), 0) << agent_->Stderr();
  std::cout << "RESULT server pod bindfs: " << kDeletes << " pod deletes drained, " << app.steps() << " steps, "
            << app.errors().size() << " errors\n";
}

// kubectl delete pod (or a preemption) as a real API server does it: the pod stays, terminating,
// while its kubelet stops it. Its successor is made at once under a second name; its server
// waits on standby and takes over the moment the old one stops, so reads wait no longer than
// that (before, the successor came only once the old pod object was gone: 8.7 s on a kubelet).
TEST_F(ServerPodE2ETest, AServerPodBeingDeletedHasItsSuccessorWaitingBeforeItStops) {
  StartAgentInCluster();
  Served v = StageServeAndRead("pv-terminating");
  ASSERT_NE(v.server, nullptr);
  const PodSeen first = v.pod;
  auto& r = v.reader;

  ASSERT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + first.name + "?graceful=true"), 200);
  ASSERT_TRUE(WaitPods([](const auto& p) { return p.size() == 2; })) << kube_->PodStore() << agent_->Stderr();
  const PodSeen second = OtherPod(first);
  EXPECT_EQ(second.name, first.name + "-2");
  Subprocess* next = RunPod(second);
  ASSERT_TRUE(agent_->WaitForStderr("from " + second.uid + " waits on standby", 1, kTestDeadline)) << agent_->Stderr();
  // The kubelet stops the old pod's container only now.
  r->Mark();
  v.server->Signal(SIGTERM);
  ASSERT_TRUE(v.server->Wait(std::chrono::milliseconds(20000)).has_value());
  ASSERT_TRUE(agent_->WaitForStderr("on standby from " + second.uid + " takes over", 1, kTestDeadline))
      << agent_->Stderr();
  EXPECT_TRUE(absl::StrContains(v.server->Stderr(), "stopping: the agent's successor server waits")) << v.server->Stderr();
  ASSERT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + first.name), 200);
  ASSERT_TRUE(r->WaitForReadsOf("hello from the export\n")) << next->Stderr() << agent_->Stderr();
  EXPECT_EQ(r->errors(), 0);
  EXPECT_EQ(agent_->CountInStderr("fresh FUSE connection mounted"), 0) << agent_->Stderr();
  // The successor stays the volume's pod: nothing more is made.
  const int lists = kube_->RequestsWith("GET /api/v1/namespaces/fk-system/pods?");
  ASSERT_TRUE(kube_->WaitForRequestsWith("GET /api/v1/namespaces/fk-system/pods?", lists + 3));
  auto pods = Pods();
  ASSERT_EQ(pods.size(), 1u) << kube_->PodStore();
  EXPECT_EQ(pods[0].uid, second.uid);
}

// The agent restarts while a server drains (its pod deleted while the agent was down): the
// server's re-deposit says it drains, so the restarted agent makes the successor and asks it to
// stop as soon as the successor waits, instead of it serving out its whole drain time.
TEST_F(ServerPodE2ETest, AServerDrainingAcrossAnAgentRestartIsStillRelievedByItsSuccessor) {
  StartAgentInCluster();
  Served v = StageServeAndRead("pv-drain-restart");
  ASSERT_NE(v.server, nullptr);
  const PodSeen first = v.pod;
  auto& r = v.reader;
  KillAgent();
  ASSERT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + first.name + "?graceful=true"), 200);
  v.server->Signal(SIGTERM);
  ASSERT_TRUE(v.server->WaitForStderr("asked to stop; serving on", 1, kTestDeadline)) << v.server->Stderr();
  RestartAgent({"--redeposit_wait_ms=100"});
  ASSERT_TRUE(agent_->WaitForStderr("re-deposited its live FUSE connection", 1, kTestDeadline)) << agent_->Stderr();
  ASSERT_TRUE(WaitPods([](const auto& p) { return p.size() == 2; })) << kube_->PodStore() << agent_->Stderr();
  const PodSeen second = OtherPod(first);
  Subprocess* next = RunPod(second);
  ASSERT_TRUE(v.server->Wait(std::chrono::milliseconds(20000)).has_value()) << v.server->Stderr() << agent_->Stderr();
  EXPECT_TRUE(absl::StrContains(v.server->Stderr(), "stopping: the agent's successor server waits")) << v.server->Stderr();
  r->Mark();
  ASSERT_TRUE(r->WaitForReadsOf("hello from the export\n")) << next->Stderr() << agent_->Stderr();
  EXPECT_EQ(r->errors(), 0);
  EXPECT_EQ(agent_->CountInStderr("fresh FUSE connection mounted"), 0) << agent_->Stderr();
}

TEST_F(ServerPodE2ETest, AnAgentRestartFindsItsServerPodAndMakesNoOther) {
  StartAgentInCluster();
  Served v = StageServeAndRead("pv-restart");
  ASSERT_NE(v.server, nullptr);
  const PodSeen pod = v.pod;
  Subprocess* server = v.server;
  auto& r = v.reader;

  KillAgent();
  RestartAgent();
  // It lists its pods and leaves this one be; the server re-deposits the live connection.
  ASSERT_TRUE(kube_->WaitForRequest("GET /api/v1/namespaces/fk-system/pods?labelSelector="));
  ASSERT_TRUE(kube_->WaitForRequests(kube_->requests() + 5));
  auto pods = Pods();
  ASSERT_EQ(pods.size(), 1u) << kube_->PodStore();
  EXPECT_EQ(pods[0].uid, pod.uid);
  r->Mark();
  ASSERT_TRUE(r->WaitForReadsOf("hello from the export\n")) << server->Stderr() << agent_->Stderr();
  EXPECT_EQ(r->errors(), 0);
  // The new agent listens in the pod's emptyDir again: a restart of the pod's server is adopted.
  ASSERT_TRUE(agent_->WaitForStderr("also listening for its server on " + pod.uid, 1, kTestDeadline))
      << agent_->Stderr();
}

TEST_F(ServerPodE2ETest, BadDeclarationsAndAnUnreachableApiServerAreClearErrorsAndLeaveNothing) {
  StartAgentInCluster();
  struct Case {
    std::string key, value, says;
  };
  for (const Case& c : std::vector<Case>{{"serverImage", "example.com/fkserve", "names no tag or digest"},
                                         {"serverUid", "0", "serverUid is 0"},
                                         {"serverArgs", "serve --root=/x", "serverArgs is not valid JSON"},
                                         {"serverResources", R"({"requests": {"cpu": "-1"}})", "is negative"}}) {
    auto ctx = ServerContext();
    ctx[c.key] = c.value;
    grpc::Status s = Stage("pv-bad", ctx);
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << c.key;
    EXPECT_TRUE(absl::StrContains(s.error_message(), c.says)) << s.error_message();
  }
  EXPECT_TRUE(Pods().empty()) << kube_->PodStore();
  EXPECT_EQ(MountCountAt(Staging("pv-bad")), 0);

  // The API server fails: nothing mounted, nothing left; the agent answers UNAVAILABLE.
  kube_->SetMode("500");
  grpc::Status s = Stage("pv-down", ServerContext());
  EXPECT_EQ(s.error_code(), grpc::UNAVAILABLE) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "failed to create server pod")) << s.error_message();
  EXPECT_EQ(MountCountAt(Staging("pv-down")), 0);
  kube_->SetMode("ok");
  EXPECT_TRUE(Pods().empty());
  // Once it is back, kubelet's retry of NodeStage succeeds.
  s = Stage("pv-down", ServerContext());
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Pods().size(), 1u);
}

TEST_F(ServerPodE2ETest, WithoutAnApiServerAVolumeThatDeclaresAServerIsRefused) {
  StartAgent();  // no in-cluster config
  grpc::Status s = Stage("pv-nocluster", ServerContext());
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "no API server")) << s.error_message();
  EXPECT_EQ(MountCountAt(Staging("pv-nocluster")), 0);
}


TEST_F(ServerPodE2ETest, APersistentVolumeAnnotationRollsTheServerPodWithoutAnError) {
  StartAgentInCluster();
  const std::string id = "pv-roll";
  ASSERT_TRUE(Stage(id, ServerContext()).ok()) << agent_->Stderr();
  const PodSeen old_pod = Pods().at(0);
  Subprocess* old_server = RunPod(old_pod);
  const std::string t1 = Pod("app-1", id), t2 = Pod("app-2", id);
  ASSERT_TRUE(PublishStaged(id, Staging(id), t1, "app-1", "app-1").ok());
  ASSERT_TRUE(PublishStaged(id, Staging(id), t2, "app-2", "app-2").ok());
  auto r1 = PodReader(t1, "hello.txt");
  auto r2 = PodReader(t2, "hello.txt");
  ASSERT_TRUE(r1->WaitForReadsOf("hello from the export\n")) << r1->setup_error() << old_server->Stderr();
  ASSERT_TRUE(r2->WaitForReadsOf("hello from the export\n")) << r2->setup_error();

  AnnotatePv("pv-roll", "example.com/fkserve:2.0");
  ASSERT_TRUE(WaitPods([](const auto& p) { return p.size() == 2; })) << kube_->PodStore() << agent_->Stderr();
  const PodSeen new_pod = OtherPod(old_pod);
  EXPECT_EQ(new_pod.image, "example.com/fkserve:2.0");
  // The old pod stays until the new one's server waits on standby; then it is deleted, and the
  // kubelet stops its container.
  Subprocess* new_server = RunPod(new_pod);
  ASSERT_TRUE(WaitPods([&](const auto& p) { return p.size() == 1 && p[0].uid == new_pod.uid; }))
      << kube_->PodStore() << new_server->Stderr() << agent_->Stderr();
  old_server->Signal(SIGTERM);
  ASSERT_TRUE(old_server->Wait(std::chrono::milliseconds(20000)).has_value());
  ASSERT_TRUE(agent_->WaitForStderr("on standby from " + new_pod.uid + " takes over", 1, kTestDeadline))
      << agent_->Stderr();
  r1->Mark();
  r2->Mark();
  ASSERT_TRUE(r1->WaitForReadsOf("hello from the export\n")) << new_server->Stderr() << agent_->Stderr();
  ASSERT_TRUE(r2->WaitForReadsOf("hello from the export\n"));
  EXPECT_EQ(r1->errors() + r2->errors(), 0) << "the roll cost no read";
  EXPECT_TRUE(agent_->WaitForStderr("ServerPodRolled", 1, kTestDeadline));
}


// Seen on a real kubelet: the agent restarted while its PV carried a new image; the new agent
// made the new pod at once, whose server connected before the old pod's server had re-deposited
// the live connection: it was given a fresh one, and every open file and working directory in
// the pods died (ENOTCONN). Now the new pod's server waits for the old one's re-deposit, and the
// roll goes on from there without an error.
TEST_F(ServerPodE2ETest, AnAgentRestartMidRollKeepsTheLiveConnection) {
  StartAgentInCluster();
  Served v = StageServeAndRead("pv-restart-roll");
  ASSERT_NE(v.server, nullptr);
  const PodSeen old_pod = v.pod;
  Subprocess* old_server = v.server;
  auto& r = v.reader;

  KillAgent();
  AnnotatePv("pv-restart-roll", "example.com/fkserve:2.0");
  // The old pod's server is slow to come back (seen in CI: the roll had already deleted its pod
  // when it would have re-deposited): it is held until the new pod's server waits on standby.
  old_server->Signal(SIGSTOP);
  RestartAgent({"--redeposit_wait_ms=100"});
  ASSERT_TRUE(WaitPods([](const auto& p) { return p.size() == 2; })) << kube_->PodStore() << agent_->Stderr();
  const PodSeen new_pod = OtherPod(old_pod);
  Subprocess* new_server = RunPod(new_pod);
  ASSERT_TRUE(agent_->WaitForStderr("from " + new_pod.uid + " has nothing to re-deposit", 1, kTestDeadline))
      << agent_->Stderr();
  // A resync now must not take the old pod away: it alone holds the live connection.
  const int lists = kube_->RequestsWith("GET /api/v1/namespaces/fk-system/pods?");
  ASSERT_TRUE(kube_->WaitForRequestsWith("GET /api/v1/namespaces/fk-system/pods?", lists + 3));
  EXPECT_NE(kube_->PodStore().find(old_pod.uid), std::string::npos) << "the old pod stays until its re-deposit";
  old_server->Signal(SIGCONT);
  ASSERT_TRUE(agent_->WaitForStderr("re-deposited its live FUSE connection", 1, kTestDeadline)) << agent_->Stderr();
  ASSERT_TRUE(WaitPods([&](const auto& p) { return p.size() == 1 && p[0].uid == new_pod.uid; }))
      << kube_->PodStore() << new_server->Stderr() << agent_->Stderr();
  old_server->Signal(SIGTERM);
  ASSERT_TRUE(old_server->Wait(std::chrono::milliseconds(20000)).has_value());
  ASSERT_TRUE(agent_->WaitForStderr("on standby from " + new_pod.uid + " takes over", 1, kTestDeadline))
      << agent_->Stderr();
  r->Mark();
  ASSERT_TRUE(r->WaitForReadsOf("hello from the export\n")) << new_server->Stderr() << agent_->Stderr();
  EXPECT_EQ(r->errors(), 0);
  EXPECT_EQ(agent_->CountInStderr("fresh FUSE connection mounted"), 0) << agent_->Stderr();
}

}  // namespace
}  // namespace fusekeeper
