// ServerPods against the API-server double over real HTTPS: a volume's pod is created once (an
// agent restart finds it), made again when deleted or evicted, rolled to a new spec only once
// the new pod's server waits, deleted when released or left over, and an unreachable or
// refusing API server is a clear error with nothing left behind.
#include "agent/serverpod/server_pods.h"
#include "agent/serverpod/server_spec.h"

#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "simdjson.h"
#include "tests/testing/api_client_test.h"
#include "tests/testing/fake_kube.h"
#include "tests/testing/loop_thread.h"

namespace fusekeeper {
namespace {

// What the controller said, in order; waited on with a deadline.
class Said {
 public:
  void Add(std::string line) {
    std::lock_guard<std::mutex> lock(mu_);
    lines_.push_back(std::move(line));
    cv_.notify_all();
  }
  // Waits until a line containing `what` has been said (at least `n` times).
  bool WaitFor(const std::string& what, int n = 1) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kTestDeadline, [&] { return CountLocked(what) >= n; });
  }
  int Count(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    return CountLocked(what);
  }
  std::string All() {
    std::lock_guard<std::mutex> lock(mu_);
    std::string out;
    for (const auto& l : lines_) out += l + "\n";
    return out;
  }

 private:
  int CountLocked(const std::string& what) const {
    int n = 0;
    for (const auto& l : lines_) n += absl::StrContains(l, what);
    return n;
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> lines_;
};

state::ServerPod Spec(const std::string& image = "team/fs:1") {
  state::ServerPod s;
  s.set_image(image);
  s.add_args("--socket={socket}");
  return s;
}

class ServerPodsTest : public ApiClientTest {
 protected:
  void DestroyClient() override { pods_.reset(); }
  void Make(std::string url = "") {
    lt_.RunOnLoop([&] { pods_.reset(); });
    KubeApiConfig api = Api(url);
    ServerPodsOptions o;
    o.settings.namespace_ = "fk-system";
    o.settings.node = "node-a";
    o.resync = absl::Milliseconds(50);
    o.request_timeout = absl::Seconds(3);
    ServerPods::Events ev;
    ev.on_pod = [this](const std::string& vid, const std::string& name, const std::string& uid) {
      said_.Add("pod " + vid + " " + name + " " + uid);
    };
    ev.on_pod_gone = [this](const std::string& vid, const std::string& name, const std::string& uid) {
      said_.Add("gone " + vid + " " + name + " " + uid);
    };
    ev.on_event = [this](const std::string& vid, const std::string& type, const std::string& reason,
                         const std::string& message) { said_.Add("event " + vid + " " + reason + " " + message); };
    ev.standby_ready = [this](const std::string&, const std::string& uid) {
      std::lock_guard<std::mutex> lock(ready_mu_);
      return ready_uids_.count(uid) > 0;
    };
    lt_.RunOnLoop([&] { pods_ = std::make_unique<ServerPods>(lt_.loop(), *http_, *pool_, api, o, std::move(ev)); });
  }
  absl::Status Create(const std::string& vid, const state::ServerPod& spec = Spec()) {
    std::promise<absl::Status> p;
    lt_.RunOnLoop([&] { pods_->Create(vid, spec, 1000, 1000, [&](absl::Status s) { p.set_value(s); }); });
    auto f = p.get_future();
    EXPECT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
    return f.get();
  }
  // The double's pods: name → uid.
  std::map<std::string, std::string> Store() {
    std::map<std::string, std::string> out;
    simdjson::dom::parser parser;
    simdjson::dom::element doc;
    const std::string json = kube_->PodStore();
    EXPECT_FALSE(parser.parse(json).get(doc)) << json;
    simdjson::dom::object obj;
    if (doc.get_object().get(obj)) return out;
    for (auto [key, pod] : obj) {
      std::string_view name, uid;
      if (pod.at_pointer("/metadata/name").get_string().get(name) ||
          pod.at_pointer("/metadata/uid").get_string().get(uid)) {
        continue;  // not a pod the fake API server would hold
      }
      out[std::string(name)] = std::string(uid);
    }
    return out;
  }
  std::string NameFor(const std::string& vid, const state::ServerPod& spec = Spec(), bool successor = false) {
    ServerPodSettings s;
    s.namespace_ = "fk-system";
    s.node = "node-a";
    return BuildServerPod(s, vid, spec, 1000, 1000, successor).name;
  }
  // Waits (on the double's log, no sleeping) until the store satisfies `pred`.
  template <typename Pred>
  bool WaitStore(Pred pred) {
    return kube_->WaitUntil([&] { return pred(Store()); });
  }
  ServerPods::Stats Stats() {
    ServerPods::Stats s;
    lt_.RunOnLoop([&] { s = pods_->stats(); });
    return s;
  }

  std::unique_ptr<ServerPods> pods_;
  Said said_;
  std::mutex ready_mu_;
  std::set<std::string> ready_uids_;
};

TEST_F(ServerPodsTest, CreatesThePodOnceAndAnAgentRestartFindsItInsteadOfMakingAnother) {
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  auto store = Store();
  ASSERT_EQ(store.size(), 1u);
  const std::string name = NameFor("vol-1");
  ASSERT_EQ(store.count(name), 1u);
  EXPECT_TRUE(said_.WaitFor("pod vol-1 " + name + " " + store[name]));
  // The POST carried the token and the manifest.
  bool posted = false;
  for (const auto& line : kube_->Log()) {
    if (absl::StrContains(line, "\"POST\"") && absl::StrContains(line, "/namespaces/fk-system/pods")) {
      posted = true;
      EXPECT_TRUE(absl::StrContains(line, "Bearer secret-token")) << line;
      EXPECT_TRUE(absl::StrContains(line, "team/fs:1")) << line;
    }
  }
  EXPECT_TRUE(posted);

  // A new agent (the old one restarted) wants the same volume: the same pod, no second one.
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  EXPECT_TRUE(said_.WaitFor("pod vol-1 " + name + " " + store[name], 2)) << said_.All();
  lt_.RunOnLoop([&] { pods_->Start(); });
  ASSERT_TRUE(kube_->WaitForRequest("GET /api/v1/namespaces/fk-system/pods?labelSelector="));
  // Resyncs leave it alone.
  ASSERT_TRUE(kube_->WaitForRequests(kube_->requests() + 3));
  EXPECT_EQ(Store(), store);
  EXPECT_EQ(Stats().deleted, 0);
  EXPECT_EQ(Stats().created, 0);
}

TEST_F(ServerPodsTest, ADeletedPodIsMadeAgain) {
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  const std::string name = NameFor("vol-1");
  const std::string first = Store()[name];
  lt_.RunOnLoop([&] { pods_->Start(); });
  ASSERT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + name), 200);
  ASSERT_TRUE(said_.WaitFor("event vol-1 ServerPodRecreated")) << said_.All();
  const std::string second = Store()[name];
  EXPECT_FALSE(second.empty());
  EXPECT_NE(second, first);
  EXPECT_TRUE(said_.WaitFor("gone vol-1 " + name + " " + first));
  EXPECT_TRUE(said_.WaitFor("pod vol-1 " + name + " " + second));
  EXPECT_EQ(Stats().recreated, 1);
}

TEST_F(ServerPodsTest, AnEvictedPodIsDeletedAndMadeAgain) {
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  const std::string name = NameFor("vol-1");
  const std::string first = Store()[name];
  lt_.RunOnLoop([&] { pods_->Start(); });
  ASSERT_EQ(kube_->Call("PATCH", "/api/v1/namespaces/fk-system/pods/" + name + "/status",
                        R"({"status":{"phase":"Failed","reason":"Evicted"}})"),
            200);
  ASSERT_TRUE(said_.WaitFor("event vol-1 ServerPodFailed")) << said_.All();
  // Its successor is made at once, beside the failed pod being deleted.
  const std::string successor = NameFor("vol-1", Spec(), /*successor=*/true);
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.size() == 1 && s.count(successor); })) << kube_->PodStore();
  EXPECT_TRUE(said_.WaitFor("gone vol-1 " + name + " " + first));
  EXPECT_TRUE(said_.WaitFor("pod vol-1 " + successor + " " + Store()[successor]));
}

// kubectl delete (or a preemption): the pod stays, terminating, until its kubelet has stopped it
// — seconds, or its whole grace period. Its successor is made at once under the second name, so
// a server waits to take over the moment the old one stops; the next one goes back to the first.
TEST_F(ServerPodsTest, ATerminatingPodGetsItsSuccessorAtOnce) {
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  const std::string name = NameFor("vol-1"), successor = NameFor("vol-1", Spec(), /*successor=*/true);
  const std::string first = Store()[name];
  lt_.RunOnLoop([&] { pods_->Start(); });
  ASSERT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + name + "?graceful=true"), 200);
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.count(successor) > 0; })) << kube_->PodStore();
  EXPECT_EQ(Store().count(name), 1u) << "the old pod is still terminating";
  EXPECT_TRUE(said_.WaitFor("pod vol-1 " + successor + " " + Store()[successor])) << said_.All();
  EXPECT_TRUE(said_.WaitFor("event vol-1 ServerPodRecreated")) << said_.All();
  // While it terminates, its server may still serve (draining): the old pod stays known.
  EXPECT_EQ(said_.Count("gone vol-1 " + name), 0) << said_.All();
  // The kubelet is done with the old pod: it is gone, and nothing more is made.
  ASSERT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + name), 200);
  EXPECT_TRUE(said_.WaitFor("gone vol-1 " + name + " " + first)) << said_.All();
  const int lists = kube_->RequestsWith("GET /api/v1/namespaces/fk-system/pods?");
  ASSERT_TRUE(kube_->WaitForRequestsWith("GET /api/v1/namespaces/fk-system/pods?", lists + 3));
  EXPECT_EQ(Store().size(), 1u) << kube_->PodStore();
  EXPECT_EQ(Stats().created, 2);
  // The successor deleted in turn: the first name is free again.
  ASSERT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + successor + "?graceful=true"), 200);
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.count(name) > 0; })) << kube_->PodStore();
  EXPECT_TRUE(kube_->WaitUntil([&] { return Stats().created == 3; }));
  // Both names terminating: nothing more until one is gone.
  ASSERT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + name + "?graceful=true"), 200);
  const int lists2 = kube_->RequestsWith("GET /api/v1/namespaces/fk-system/pods?");
  ASSERT_TRUE(kube_->WaitForRequestsWith("GET /api/v1/namespaces/fk-system/pods?", lists2 + 3));
  EXPECT_EQ(Stats().created, 3);
  ASSERT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + successor), 200);
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.size() == 2; })) << kube_->PodStore();
  EXPECT_TRUE(kube_->WaitUntil([&] { return Stats().created == 4; }));
}

TEST_F(ServerPodsTest, ReleaseDeletesThePod) {
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  ASSERT_TRUE(Create("vol-2").ok());
  ASSERT_EQ(Store().size(), 2u);
  lt_.RunOnLoop([&] { pods_->Release("vol-1"); });
  ASSERT_TRUE(WaitStore([](const auto& s) { return s.size() == 1; })) << kube_->PodStore();
  EXPECT_EQ(Store().count(NameFor("vol-2")), 1u);
  EXPECT_TRUE(said_.WaitFor("gone vol-1"));
}

TEST_F(ServerPodsTest, LeftoversAreDeletedOnlyAfterStart) {
  Make();
  ASSERT_TRUE(Create("vol-left").ok());
  ASSERT_TRUE(Create("vol-kept").ok());
  // A new agent that has not yet learnt its staged volumes: resyncs leave every pod alone.
  Make();
  lt_.RunOnLoop([&] { pods_->Want("vol-kept", Spec(), 1000, 1000); });
  lt_.RunOnLoop([&] { pods_->ResyncSoon(); });  // not started: nothing happens
  EXPECT_EQ(Store().size(), 2u);
  lt_.RunOnLoop([&] { pods_->Start(); });
  ASSERT_TRUE(WaitStore([](const auto& s) { return s.size() == 1; })) << kube_->PodStore();
  EXPECT_EQ(Store().count(NameFor("vol-kept")), 1u);
  EXPECT_EQ(Stats().created, 0);
}

TEST_F(ServerPodsTest, ARollKeepsTheOldPodUntilTheNewOnesServerWaits) {
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  lt_.RunOnLoop([&] { pods_->Start(); });
  const std::string old_name = NameFor("vol-1"), new_name = NameFor("vol-1", Spec("team/fs:2"));
  lt_.RunOnLoop([&] { pods_->Want("vol-1", Spec("team/fs:2"), 1000, 1000); });
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.count(new_name) > 0; }));
  const std::string new_uid = Store()[new_name];
  ASSERT_TRUE(said_.WaitFor("pod vol-1 " + new_name + " " + new_uid));
  // Resyncs go on; the old pod stays while the new one's server is not waiting.
  const int before = kube_->requests();
  ASSERT_TRUE(kube_->WaitForRequests(before + 3));
  EXPECT_EQ(Store().count(old_name), 1u);
  {
    std::lock_guard<std::mutex> lock(ready_mu_);
    ready_uids_.insert(new_uid);
  }
  ASSERT_TRUE(said_.WaitFor("event vol-1 ServerPodRolled")) << said_.All();
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.size() == 1 && s.count(new_name); })) << kube_->PodStore();
  EXPECT_TRUE(said_.WaitFor("gone vol-1 " + old_name));
  EXPECT_EQ(Stats().rolled, 1);
}

TEST_F(ServerPodsTest, AnUnreachableApiServerIsAClearErrorAndNothingIsWanted) {
  Make("https://127.0.0.1:1");
  absl::Status s = Create("vol-1");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "could not be reached")) << s;
  lt_.RunOnLoop([&] { EXPECT_TRUE(pods_->wanted().empty()); });
}

TEST_F(ServerPodsTest, ARefusalNamesTheRbacItNeeds) {
  Make();
  kube_->SetMode("403");
  absl::Status s = Create("vol-1");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "pods create")) << s;
  kube_->SetMode("500");
  EXPECT_EQ(Create("vol-1").code(), absl::StatusCode::kUnavailable);
  kube_->SetMode("ok");
  EXPECT_TRUE(Store().empty());
}

TEST_F(ServerPodsTest, AnApiServerThatGoesAwayLeavesKnownPodsKnown) {
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  lt_.RunOnLoop([&] { pods_->Start(); });
  kube_->SetMode("garbage");
  const int before = kube_->requests();
  ASSERT_TRUE(kube_->WaitForRequests(before + 3));
  kube_->SetMode("ok");
  EXPECT_EQ(said_.Count("gone"), 0) << said_.All();
  EXPECT_GE(Stats().api_errors, 1);
  EXPECT_EQ(Store().size(), 1u);
}


std::string PvList(const std::string& handle, const std::string& image, const std::string& driver = "fusekeeper.csi",
                   const std::string& rollout = "") {
  std::string annotations = image.empty() ? "{}" : R"({"fusekeeper.io/server-image":")" + image + R"(")" +
                                                       (rollout.empty() ? "" : R"(,"fusekeeper.io/server-image-rollout":")" + rollout + R"(")") + "}";
  return R"({"kind":"PersistentVolumeList","items":[{"metadata":{"name":"pv-x","annotations":)" + annotations +
         R"(},"spec":{"csi":{"driver":")" + driver + R"(","volumeHandle":")" + handle + R"("}}}]})";
}

TEST(ParseVolumeListTest, ReadsOurPvsImageAnnotationsAndSkipsOthers) {
  auto v = ParseVolumeList(PvList("vol-1", "team/fs:2"), "fusekeeper.csi");
  ASSERT_TRUE(v.ok());
  ASSERT_EQ(v->size(), 1u);
  EXPECT_EQ((*v)[0].volume_handle, "vol-1");
  EXPECT_EQ((*v)[0].server_image, "team/fs:2");
  v = ParseVolumeList(PvList("vol-1", "team/fs:2", "other.csi"), "fusekeeper.csi");
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(v->empty());
  EXPECT_FALSE(ParseVolumeList("[1,2]", "fusekeeper.csi").ok());
  v = ParseVolumeList(PvList("vol-1", "team/fs:2", "fusekeeper.csi", "25%"), "fusekeeper.csi");
  ASSERT_TRUE(v.ok());
  ASSERT_EQ(v->size(), 1u);
  EXPECT_EQ((*v)[0].rollout, "25%");
}

// A roll in batches: a node outside the annotation's share keeps its server; raising the share
// past the node's bucket rolls it; a share that is no share is refused and changes nothing.
TEST_F(ServerPodsTest, ARolloutShareRollsOnlyTheNodesItCovers) {
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  lt_.RunOnLoop([&] { pods_->Start(); });
  const std::string old_name = NameFor("vol-1"), new_name = NameFor("vol-1", Spec("team/fs:2"));
  const int bucket = RolloutBucket("vol-1", "node-a");
  const std::string pvs = "GET /api/v1/persistentvolumes";
  kube_->SetObjects({{"/api/v1/persistentvolumes", PvList("vol-1", "team/fs:2", "fusekeeper.csi",
                                                          std::to_string(bucket) + "%")}});
  // Two more resyncs read the PV list after it changed: this node is not in the batch.
  const int seen = kube_->RequestsWith(pvs);
  ASSERT_TRUE(kube_->WaitForRequestsWith(pvs, seen + 3));
  EXPECT_EQ(said_.Count("ServerPodRolling"), 0) << said_.All();
  EXPECT_EQ(Store().size(), 1u) << kube_->PodStore();
  kube_->SetObjects({{"/api/v1/persistentvolumes", PvList("vol-1", "team/fs:2", "fusekeeper.csi", "150%")}});
  ASSERT_TRUE(said_.WaitFor("event vol-1 ServerImageRefused")) << said_.All();
  EXPECT_TRUE(absl::StrContains(said_.All(), "'150%' is not a share of nodes")) << said_.All();
  kube_->SetObjects({{"/api/v1/persistentvolumes", PvList("vol-1", "team/fs:2", "fusekeeper.csi",
                                                          std::to_string(bucket + 1))}});
  ASSERT_TRUE(said_.WaitFor("event vol-1 ServerPodRolling")) << said_.All();
  EXPECT_TRUE(absl::StrContains(said_.All(), "this node is among the first " + std::to_string(bucket + 1) + "%"))
      << said_.All();
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.count(new_name) > 0; })) << kube_->PodStore();
  {
    std::lock_guard<std::mutex> lock(ready_mu_);
    ready_uids_.insert(Store()[new_name]);
  }
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.size() == 1 && s.count(new_name); })) << kube_->PodStore();
  // The share lowered below the node again: it rolls back.
  kube_->SetObjects({{"/api/v1/persistentvolumes", PvList("vol-1", "team/fs:2", "fusekeeper.csi", "0%")}});
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.count(old_name) > 0; })) << kube_->PodStore();
}

TEST_F(ServerPodsTest, APersistentVolumeAnnotationRollsTheServerAndABadOneIsRefused) {
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  lt_.RunOnLoop([&] { pods_->Start(); });
  const std::string old_name = NameFor("vol-1"), new_name = NameFor("vol-1", Spec("team/fs:2"));
  // An image without a tag: refused with a Warning, nothing changes.
  kube_->SetObjects({{"/api/v1/persistentvolumes", PvList("vol-1", "team/fs")}});
  ASSERT_TRUE(said_.WaitFor("event vol-1 ServerImageRefused")) << said_.All();
  EXPECT_EQ(Store().size(), 1u);
  kube_->SetObjects({{"/api/v1/persistentvolumes", PvList("vol-1", "team/fs:2")}});
  ASSERT_TRUE(said_.WaitFor("event vol-1 ServerPodRolling")) << said_.All();
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.count(new_name) > 0; })) << kube_->PodStore();
  EXPECT_EQ(Store().count(old_name), 1u) << "kept until the new pod's server waits";
  {
    std::lock_guard<std::mutex> lock(ready_mu_);
    ready_uids_.insert(Store()[new_name]);
  }
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.size() == 1 && s.count(new_name); })) << kube_->PodStore();
  // The annotation removed: back to the declared image, the same way.
  kube_->SetObjects({{"/api/v1/persistentvolumes", PvList("vol-1", "")}});
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.count(old_name) > 0; })) << kube_->PodStore();
  {
    std::lock_guard<std::mutex> lock(ready_mu_);
    ready_uids_.insert(Store()[old_name]);
  }
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.size() == 1 && s.count(old_name); })) << kube_->PodStore();
  EXPECT_EQ(Stats().rolled, 2);
}


// Seen on a real kubelet: the PV's image annotation arrived while NodeStage's POST of the declared
// pod was in flight; the pod the volume then wanted was never made (a 'creating' flag of the
// volume, not of the pod, stayed set).
TEST_F(ServerPodsTest, ASpecChangeWhileTheFirstPodIsBeingCreatedStillGetsItsPod) {
  Make();
  lt_.RunOnLoop([&] { pods_->Start(); });
  std::promise<absl::Status> created;
  lt_.RunOnLoop([&] {
    pods_->Create("vol-1", Spec(), 1000, 1000, [&](absl::Status s) { created.set_value(s); });
    pods_->Want("vol-1", Spec("team/fs:2"), 1000, 1000);  // before the POST's answer
  });
  auto f = created.get_future();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  const std::string new_name = NameFor("vol-1", Spec("team/fs:2"));
  ASSERT_TRUE(WaitStore([&](const auto& s) { return s.count(new_name) > 0; })) << kube_->PodStore();
}


// After an agent restart in the middle of a roll, the pod being replaced is known too: its server
// may be the one serving, and must be able to re-deposit through its emptyDir.
TEST_F(ServerPodsTest, AfterARestartMidRollBothPodsOfTheVolumeAreKnown) {
  Make();
  ASSERT_TRUE(Create("vol-1").ok());
  const std::string old_name = NameFor("vol-1"), new_name = NameFor("vol-1", Spec("team/fs:2"));
  ASSERT_TRUE(Create("vol-1", Spec("team/fs:2")).ok());
  ASSERT_EQ(Store().size(), 2u);
  Make();  // the agent restarts, wanting the new spec
  lt_.RunOnLoop([&] {
    pods_->Want("vol-1", Spec("team/fs:2"), 1000, 1000);
    pods_->Start();
  });
  auto store = Store();
  EXPECT_TRUE(said_.WaitFor("pod vol-1 " + new_name + " " + store[new_name], 2)) << said_.All();
  EXPECT_TRUE(said_.WaitFor("pod vol-1 " + old_name + " " + store[old_name], 2)) << said_.All();
  EXPECT_EQ(Store().size(), 2u) << "the old one stays until the new one's server waits";
}


// A node whose volumes want no server pod lists once at start and then asks nothing; the first
// volume that wants one starts the resyncs again (a pod deleted later is made again).
TEST_F(ServerPodsTest, AnIdleNodeWakesWhenAVolumeWantsAServer) {
  Make();
  lt_.RunOnLoop([&] { pods_->Start(); });
  ASSERT_TRUE(kube_->WaitForRequest("GET /api/v1/namespaces/fk-system/pods?labelSelector="));
  ASSERT_TRUE(Create("vol-1").ok());
  const std::string name = NameFor("vol-1");
  ASSERT_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk-system/pods/" + name), 200);
  ASSERT_TRUE(said_.WaitFor("event vol-1 ServerPodRecreated")) << said_.All();
  EXPECT_EQ(Store().count(name), 1u);
}

}  // namespace
}  // namespace fusekeeper
