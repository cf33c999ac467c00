// Recovery as pods see it, with the real agent and the real reference server (fkserve, as uid
// 65534), reading through container-like pod views (tests/volume/pod_reader.h: an rslave copy
// of the target in a mount namespace of its own), in one run:
//  - BM_PodViewHeal/adopt: a server is SIGKILLed and restarted; it adopts the kept connection.
//    Time from the dead server's exit to the first read completing in the pod view.
//  - BM_PodViewHeal/fresh: the connection is aborted (fusectl) and a server restarted; the agent
//    stacks a fresh connection on the global mount. Time from the abort to the first successful
//    read in the pod view after the failing ones. p50/p99 over the iterations (target p99 50 ms).
//  - BM_AgentRestartServed/100: 100 served staged volumes under paced pod-view reads; the agent is
//    SIGKILLed and restarted; every server re-deposits; then every server is killed and
//    restarted. Counters: time to all re-deposited, abnormal stats, read errors, adoptions, fresh
//    connections (want 0, 0, 100, 0).
//  - BM_AgentStartReady/1000: the agent restarted with 1000 FUSE volumes in its state: exec →
//    ready (Probe) and → all 1000 handoff endpoints listening.
// Needs root (mount namespaces, /dev/fuse). bazel run -c opt //bench:pod_recovery_bench
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/fuse/fuse_mount.h"
#include "agent/volume/state_store.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"
#include "proto/csi.grpc.pb.h"
#include "tests/testing/csi_client.h"
#include "tests/testing/subprocess.h"
#include "tests/volume/pod_reader.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;
using namespace csi::v1;
constexpr uid_t kServerUid = 65534;
const std::string kWant = "hello from the export\n";
const std::string kOther = "hello from the other export\n";

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// One node: a tmpfs with an rshared kubelet dir, the agent, fkserve, an export.
class FakeNode {
 public:
  FakeNode() {
    char t[] = "/tmp/fk-podbench-XXXXXX";
    root_ = mkdtemp(t);
    PCHECK(mount("tmpfs", root_.c_str(), "tmpfs", 0, "mode=0755") == 0);
    kubelet_ = root_ + "/kubelet";
    fs::create_directories(kubelet_ + "/pods");
    PCHECK(mount(kubelet_.c_str(), kubelet_.c_str(), nullptr, MS_BIND, nullptr) == 0);
    PCHECK(mount(nullptr, kubelet_.c_str(), nullptr, MS_SHARED | MS_REC, nullptr) == 0);
    export_ = root_ + "/export";
    // A second export with other content: the server a fresh connection goes to serves it, so a
    // read of it can only have come through the repaired mount.
    for (const auto& [dir, content] : {std::pair<std::string, std::string>{export_, kWant}, {export_ + "-b", kOther}}) {
      fs::create_directories(dir);
      { std::ofstream(dir + "/hello.txt") << content; }
      PCHECK(chown(dir.c_str(), kServerUid, kServerUid) == 0);
    }
    fkserve_ = root_ + "/fkserve";
    fs::copy_file(RunfilePath("agent/fkserve/fkserve"), fkserve_);
    chmod(fkserve_.c_str(), 0755);
  }
  ~FakeNode() {
    readers_.clear();
    servers_.clear();
    agent_.reset();
    umount2(root_.c_str(), MNT_DETACH);
  }
  void StartAgent() {
    agent_ = std::make_unique<Subprocess>(std::vector<std::string>{
        RunfilePath("agent/fusekeeper"), "--endpoint=unix://" + root_ + "/csi.sock", "--node_id=n",
        "--kubelet_dir=" + kubelet_, "--state_dir=" + root_ + "/state", "--handoff_timeout_ms=3600000",
        "--metrics_address=", "--audit_period_ms=600000"});
    // Dialled once the socket listens: a channel that first meets the dead agent's socket file
    // backs off for seconds, which would be measured instead of the agent.
    CHECK(agent_->WaitForStderr("CSI server listening", 1, std::chrono::seconds(60))) << agent_->Stderr();
    channel_ = DialUnixSocket(root_ + "/csi.sock");
    CHECK(WaitForReadyAgent(channel_, std::chrono::steady_clock::now() + std::chrono::seconds(60))) << agent_->Stderr();
    node_ = csi::v1::Node::NewStub(channel_);
  }
  void KillAgent() {
    agent_->Signal(SIGKILL);
    CHECK(agent_->Wait(std::chrono::seconds(20)).has_value());
  }
  // Stages volume `id`, publishes it into one pod; returns the pod's target.
  std::string StageAndPublish(const std::string& id) {
    const std::string staging = kubelet_ + "/plugins/kubernetes.io/csi/fusekeeper.csi/" + id + "/globalmount";
    fs::create_directories(staging);
    const std::string pod = "pod-" + id;
    const std::string target = kubelet_ + "/pods/" + pod + "/volumes/kubernetes.io~csi/" + id + "/mount";
    fs::create_directories(target.substr(0, target.rfind('/')));
    NodeStageVolumeRequest s;
    s.set_volume_id(id);
    s.set_staging_target_path(staging);
    *s.mutable_volume_capability() = MountCapability();
    (*s.mutable_volume_context())["kind"] = "fuse";
    (*s.mutable_volume_context())["serverUid"] = std::to_string(kServerUid);
    NodeStageVolumeResponse sr;
    CHECK(Call([&](grpc::ClientContext* c) { return node_->NodeStageVolume(c, s, &sr); }));
    NodePublishVolumeRequest p;
    p.set_volume_id(id);
    p.set_staging_target_path(staging);
    p.set_target_path(target);
    *p.mutable_volume_capability() = MountCapability();
    (*p.mutable_volume_context())["csi.storage.k8s.io/pod.uid"] = pod;
    (*p.mutable_volume_context())["csi.storage.k8s.io/pod.name"] = pod;
    (*p.mutable_volume_context())["csi.storage.k8s.io/pod.namespace"] = "default";
    NodePublishVolumeResponse pr;
    CHECK(Call([&](grpc::ClientContext* c) { return node_->NodePublishVolume(c, p, &pr); }));
    staging_[id] = staging;
    return target;
  }
  bool Abnormal(const std::string& id, const std::string& target) {
    NodeGetVolumeStatsRequest r;
    r.set_volume_id(id);
    r.set_volume_path(target);
    NodeGetVolumeStatsResponse resp;
    CHECK(Call([&](grpc::ClientContext* c) { return node_->NodeGetVolumeStats(c, r, &resp); }));
    return resp.volume_condition().abnormal();
  }
  std::string Socket(const std::string& id) { return root_ + "/state/sockets/" + Sha256Hex(id).substr(0, 32) + ".sock"; }
  Subprocess* StartServer(const std::string& id, bool other_export = false) {
    servers_[id] = std::make_unique<Subprocess>(
        std::vector<std::string>{fkserve_, "--socket=" + Socket(id), "serve",
                                 "--root=" + export_ + (other_export ? "-b" : "")},
        std::vector<std::string>{}, [] {
          if (setresgid(kServerUid, kServerUid, kServerUid) != 0 || setresuid(kServerUid, kServerUid, kServerUid) != 0) {
            _exit(99);
          }
        });
    return servers_[id].get();
  }
  // The old server of `id` gone (killed or exited), as a Subprocess to reap.
  std::unique_ptr<Subprocess> TakeServer(const std::string& id) { return std::move(servers_[id]); }
  Reader& PodView(const std::string& target, int pace_ms = 0) {
    const std::string view = root_ + "/views/" + std::to_string(readers_.size());
    fs::create_directories(view);
    readers_.push_back(Reader::InPod(target, "hello.txt", view, pace_ms));
    return *readers_.back();
  }
  uint32_t GlobalConnection(const std::string& id) {
    struct stat st;
    PCHECK(stat(staging_[id].c_str(), &st) == 0);
    return minor(st.st_dev);
  }
  Subprocess& agent() { return *agent_; }

 private:
  template <typename F>
  bool Call(F f) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status s = f(&c);
    LOG_IF(ERROR, !s.ok()) << s.error_message();
    return s.ok();
  }

  std::string root_, kubelet_, export_, fkserve_;
  std::unique_ptr<Subprocess> agent_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<csi::v1::Node::Stub> node_;
  std::map<std::string, std::unique_ptr<Subprocess>> servers_;
  std::map<std::string, std::string> staging_;
  std::vector<std::unique_ptr<Reader>> readers_;
};

void BM_PodViewHeal(benchmark::State& state) {
  const bool fresh = state.range(0) == 1;
  FakeNode node;
  node.StartAgent();
  const std::string target = node.StageAndPublish("heal");
  node.StartServer("heal");
  Reader& view = node.PodView(target);
  CHECK(view.WaitForReadsOf(kWant)) << view.setup_error() << node.agent().Stderr();
  std::vector<double> micros;
  int64_t errors = 0;
  bool other = false;
  for (auto _ : state) {
    std::unique_ptr<Subprocess> old = node.TakeServer("heal");
    if (fresh) {
      other = !other;
      view.Mark(other ? kOther : kWant);
      CHECK(AbortFuseConnectionBlocking(node.GlobalConnection("heal")).ok());
      node.StartServer("heal", other);  // the sidecar restarts at once
    } else {
      old->Signal(SIGKILL);
      CHECK(old->Wait(std::chrono::seconds(20)).has_value());
      view.Mark();  // from the dead server's exit: every read now waits for the next server
      node.StartServer("heal");
    }
    auto healed = view.HealedAfterMark();
    CHECK(healed.has_value()) << node.agent().Stderr();
    errors += view.errors_after_mark();
    micros.push_back(static_cast<double>(healed->count()));
    state.SetIterationTime(static_cast<double>(healed->count()) / 1e6);
    CHECK(old->Wait(std::chrono::seconds(20)).has_value());
  }
  state.counters["p50_ms"] = Percentile(micros, 0.50) / 1000;
  state.counters["p99_ms"] = Percentile(micros, 0.99) / 1000;
  state.counters["read_errors_per_repair"] = static_cast<double>(errors) / static_cast<double>(micros.size());
}
BENCHMARK(BM_PodViewHeal)->ArgName("fresh")->Arg(0)->Arg(1)->Iterations(100)->UseManualTime()->Unit(benchmark::kMillisecond);

void BM_AgentRestartServed(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  for (auto _ : state) {
    FakeNode node;
    node.StartAgent();
    std::vector<std::string> targets;
    std::vector<Reader*> views;
    for (int i = 0; i < n; ++i) {
      targets.push_back(node.StageAndPublish(absl::StrCat("v", i)));
      node.StartServer(absl::StrCat("v", i));
    }
    for (int i = 0; i < n; ++i) {
      views.push_back(&node.PodView(targets[i], /*pace_ms=*/20));
      CHECK(views.back()->WaitForReadsOf(kWant, 2)) << views.back()->setup_error();
    }
    for (Reader* v : views) v->Mark();
    const auto start = std::chrono::steady_clock::now();
    node.KillAgent();
    node.StartAgent();
    CHECK(node.agent().WaitForStderr("re-deposited its live FUSE connection", n, std::chrono::seconds(60)))
        << node.agent().Stderr();
    const double redeposit_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(redeposit_ms / 1000);
    int abnormal = 0;
    for (int i = 0; i < n; ++i) abnormal += node.Abnormal(absl::StrCat("v", i), targets[i]);
    for (int i = 0; i < n; ++i) {
      std::unique_ptr<Subprocess> old = node.TakeServer(absl::StrCat("v", i));
      old->Signal(SIGKILL);
      CHECK(old->Wait(std::chrono::seconds(20)).has_value());
      node.StartServer(absl::StrCat("v", i));
    }
    node.agent().WaitForStderr("FuseServerRestarted", n, std::chrono::seconds(60));
    for (Reader* v : views) CHECK(v->WaitForReadsOf(kWant, 2));
    int64_t errors = 0;
    for (Reader* v : views) errors += v->errors_after_mark();
    state.counters["redeposit_all_ms"] = redeposit_ms;
    state.counters["abnormal_stats"] = abnormal;
    state.counters["read_errors"] = static_cast<double>(errors);
    state.counters["adopted"] = node.agent().CountInStderr("FuseServerRestarted: a restarted");
    state.counters["fresh_connections"] = node.agent().CountInStderr("mounting a fresh connection");
  }
}
BENCHMARK(BM_AgentRestartServed)->Arg(100)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

void BM_AgentStartReady(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  FakeNode node;
  node.StartAgent();
  for (int i = 0; i < n; ++i) node.StageAndPublish(absl::StrCat("r", i));
  for (auto _ : state) {
    node.KillAgent();
    const auto start = std::chrono::steady_clock::now();
    node.StartAgent();
    const double ready_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    CHECK(node.agent().WaitForStderr("waits for its server on", n, std::chrono::seconds(120)));
    const double listening_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(listening_ms / 1000);
    state.counters["ready_ms"] = ready_ms;
    state.counters["all_listening_ms"] = listening_ms;
  }
}
BENCHMARK(BM_AgentStartReady)->Arg(1000)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace fusekeeper

int main(int argc, char** argv) {
  PCHECK(unshare(CLONE_NEWNS) == 0) << "pod_recovery_bench needs root";
  PCHECK(mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
