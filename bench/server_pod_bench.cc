// Server pods (agent/serverpod) with the real agent against the API-server double (real HTTPS),
// the bench playing the kubelet (the pod's emptyDir, fkserve started as the pod declares):
//  - BM_StageToFirstAnswer: NodeStage of a volume that declares its server (the pod POSTed, then
//    the mount), the "kubelet" starting the pod's server, and the first answer through the
//    staged mount (a statfs). Counters: stage_ms (the RPC, the POST included), answer_ms (server
//    start → first answer: the agent finding the emptyDir, listening, the handoff), p50/p99.
//  - BM_DeletedServerPodReadStall/drain:0|1: a served volume's server pod deleted (kubectl delete:
//    the object goes, the kubelet SIGTERMs the server) while a reader statfs()es the mount in a
//    loop; the "kubelet" starts the successor 500 ms after it appears (a container start, as
//    measured on a real kubelet). Counter: the reader's longest wait (p50/max over iterations),
//    the server draining (the default) or stopping at once (--server_drain_ms=0), side by side.
//  - BM_AgentRssPerServerPodVolume/100: the agent's RSS before and after 100 such volumes staged
//    and served: the added bytes per managed volume.
// Needs root. bazel build -c opt //bench:server_pod_bench && bazel-out/k8-opt/bin/bench/server_pod_bench
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/statfs.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"
#include "proto/csi.grpc.pb.h"
#include "simdjson.h"
#include "tests/testing/csi_client.h"
#include "tests/testing/fake_kube.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;
using namespace csi::v1;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}
double Ms(std::chrono::steady_clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

class FakeNode {
 public:
  explicit FakeNode(std::vector<std::string> extra_flags = {}) {
    char t[] = "/tmp/fk-srvbench-XXXXXX";
    root_ = mkdtemp(t);
    PCHECK(mount("tmpfs", root_.c_str(), "tmpfs", 0, "mode=0755") == 0);
    kubelet_ = root_ + "/kubelet";
    fs::create_directories(kubelet_ + "/pods");
    export_ = root_ + "/export";
    fs::create_directories(export_);
    { std::ofstream(export_ + "/hello.txt") << "hello\n"; }
    fkserve_ = root_ + "/fkserve";
    fs::copy_file(RunfilePath("agent/fkserve/fkserve"), fkserve_);
    chmod(fkserve_.c_str(), 0755);
    fs::create_directories(root_ + "/kube");
    kube_ = std::make_unique<FakeKube>(root_ + "/kube");
    CHECK(kube_->ok()) << kube_->Diagnostics();
    fs::create_directories(root_ + "/secrets");
    fs::copy_file(kube_->ca_file(), root_ + "/secrets/ca.crt");
    { std::ofstream(root_ + "/secrets/token") << "t"; }
    std::vector<std::string> argv = {RunfilePath("agent/fusekeeper"), "--endpoint=unix://" + root_ + "/csi.sock",
                                     "--node_id=n", "--kubelet_dir=" + kubelet_, "--state_dir=" + root_ + "/state",
                                     "--kube_secrets_dir=" + root_ + "/secrets", "--server_namespace=fk",
                                     "--server_pod_resync_ms=60000", "--audit_period_ms=600000"};
    argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
    agent_ = std::make_unique<Subprocess>(
        argv,
        std::vector<std::string>{"KUBERNETES_SERVICE_HOST=127.0.0.1",
                                 "KUBERNETES_SERVICE_PORT=" + std::to_string(kube_->port())});
    CHECK(agent_->WaitForStderr("CSI server listening", 1, std::chrono::seconds(60))) << agent_->Stderr();
    channel_ = DialUnixSocket(root_ + "/csi.sock");
    CHECK(WaitForReadyAgent(channel_, std::chrono::steady_clock::now() + std::chrono::seconds(60)));
    node_ = csi::v1::Node::NewStub(channel_);
  }
  ~FakeNode() {
    servers_.clear();
    agent_.reset();
    kube_.reset();
    umount2(root_.c_str(), MNT_DETACH);
  }
  // NodeStage of a volume that declares its server; returns its staging path.
  std::string Stage(const std::string& id) {
    const std::string staging = kubelet_ + "/plugins/kubernetes.io/csi/fusekeeper.csi/" + id + "/globalmount";
    fs::create_directories(staging);
    NodeStageVolumeRequest s;
    s.set_volume_id(id);
    s.set_staging_target_path(staging);
    *s.mutable_volume_capability() = MountCapability();
    auto& ctx = *s.mutable_volume_context();
    ctx["kind"] = "fuse";
    ctx["serverUid"] = "65534";
    ctx["serverImage"] = "example.com/fkserve:1.0";
    ctx["serverArgs"] = R"(["serve", "--root=)" + export_ + R"("])";
    NodeStageVolumeResponse r;
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status st = node_->NodeStageVolume(&c, s, &r);
    CHECK(st.ok()) << st.error_message() << agent_->Stderr();
    return staging;
  }
  // The pod of volume `id` in the double: its name and uid (empty if none).
  std::pair<std::string, std::string> PodOf(const std::string& id) {
    const std::string json = kube_->PodStore();
    simdjson::dom::parser parser;
    simdjson::dom::element doc = parser.parse(json);
    for (auto [key, pod] : doc.get_object()) {
      std::string_view name, uid, vid;
      if (!pod.at_pointer("/metadata/annotations/fusekeeper.io~1volume-id").get_string().get(vid) && vid == id &&
          !pod.at_pointer("/metadata/uid").get_string().get(uid) &&
          !pod.at_pointer("/metadata/name").get_string().get(name)) {
        return {std::string(name), std::string(uid)};
      }
    }
    return {};
  }
  // The kubelet's part for the pod of volume `id`: its emptyDir and its server.
  Subprocess* RunPod(const std::string& id) {
    const std::string uid = PodOf(id).second;
    CHECK(!uid.empty()) << kube_->PodStore();
    const std::string dir = kubelet_ + "/pods/" + uid + "/volumes/kubernetes.io~empty-dir/fusekeeper-handoff";
    fs::create_directories(dir);
    chmod(dir.c_str(), 0777);
    const std::string link = root_ + "/p" + std::to_string(servers_.size());
    fs::create_directory_symlink(dir, link);
    servers_.push_back(std::make_unique<Subprocess>(
        std::vector<std::string>{fkserve_, "--socket=" + link + "/handoff.sock", "serve", "--root=" + export_},
        std::vector<std::string>{}, [] {
          if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) _exit(99);
        }));
    return servers_.back().get();
  }
  // kubectl delete of the volume's pod: the object goes, the kubelet SIGTERMs `server`. Returns
  // once the agent has made the next pod (its uid).
  std::string DeletePod(const std::string& id, Subprocess* server) {
    const auto [name, uid] = PodOf(id);
    CHECK_EQ(kube_->Call("DELETE", "/api/v1/namespaces/fk/pods/" + name), 200);
    server->Signal(SIGTERM);
    std::string next;
    CHECK(kube_->WaitUntil([&] {
      next = PodOf(id).second;
      return !next.empty() && next != uid;
    })) << kube_->PodStore() << agent_->Stderr();
    return next;
  }
  pid_t agent_pid() const { return agent_->pid(); }

 private:
  std::string root_, kubelet_, export_, fkserve_;
  std::unique_ptr<FakeKube> kube_;
  std::unique_ptr<Subprocess> agent_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<csi::v1::Node::Stub> node_;
  std::vector<std::unique_ptr<Subprocess>> servers_;
};

// A statfs through the mount, bounded (a server that never answers fails the bench, not hangs it).
void FirstAnswer(const std::string& path) {
  auto f = std::async(std::launch::async, [path] {
    struct statfs s;
    return statfs(path.c_str(), &s);
  });
  CHECK(f.wait_for(std::chrono::seconds(30)) == std::future_status::ready) << "no answer through " << path;
  CHECK_EQ(f.get(), 0);
}

long RssKb(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return 0;
}

void BM_StageToFirstAnswer(benchmark::State& state) {
  FakeNode node;
  std::vector<double> stage_ms, answer_ms, total_ms;
  int i = 0;
  for (auto _ : state) {
    const std::string id = absl::StrCat("pv-", i++);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string staging = node.Stage(id);
    const auto t1 = std::chrono::steady_clock::now();
    node.RunPod(id);
    const auto t2 = std::chrono::steady_clock::now();
    FirstAnswer(staging);
    const auto t3 = std::chrono::steady_clock::now();
    stage_ms.push_back(Ms(t1 - t0));
    answer_ms.push_back(Ms(t3 - t2));
    total_ms.push_back(Ms(t3 - t0));
  }
  state.counters["stage_ms_p50"] = Percentile(stage_ms, 0.5);
  state.counters["stage_ms_p99"] = Percentile(stage_ms, 0.99);
  state.counters["answer_ms_p50"] = Percentile(answer_ms, 0.5);
  state.counters["answer_ms_p99"] = Percentile(answer_ms, 0.99);
  state.counters["total_ms_p50"] = Percentile(total_ms, 0.5);
}
BENCHMARK(BM_StageToFirstAnswer)->Iterations(30)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_DeletedServerPodReadStall(benchmark::State& state) {
  const bool drain = state.range(0) == 1;
  FakeNode node(drain ? std::vector<std::string>{} : std::vector<std::string>{"--server_drain_ms=0"});
  std::vector<double> stall_ms;
  int i = 0;
  for (auto _ : state) {
    const std::string id = absl::StrCat("pv-", i++);
    const std::string staging = node.Stage(id);
    Subprocess* server = node.RunPod(id);
    FirstAnswer(staging);
    std::atomic<bool> stop{false};
    double worst = 0;
    std::thread reader([&] {
      while (!stop) {
        const auto t0 = std::chrono::steady_clock::now();
        struct statfs st;
        CHECK_EQ(statfs(staging.c_str(), &st), 0);
        worst = std::max(worst, Ms(std::chrono::steady_clock::now() - t0));
      }
    });
    node.DeletePod(id, server);
    // The kubelet starts the new pod's container (measured: about 500 ms on a real kubelet).
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    node.RunPod(id);
    CHECK(server->Wait(std::chrono::milliseconds(30000)).has_value()) << "the old server never stopped";
    FirstAnswer(staging);
    stop = true;
    reader.join();
    stall_ms.push_back(worst);
  }
  state.counters["read_stall_ms_p50"] = Percentile(stall_ms, 0.5);
  state.counters["read_stall_ms_max"] = Percentile(stall_ms, 1.0);
}
BENCHMARK(BM_DeletedServerPodReadStall)->ArgName("drain")->Arg(0)->Arg(1)->Iterations(10)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_AgentRssPerServerPodVolume(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  for (auto _ : state) {
    FakeNode node;
    const long before = RssKb(node.agent_pid());
    for (int i = 0; i < n; ++i) {
      const std::string id = absl::StrCat("pv-", i);
      const std::string staging = node.Stage(id);
      node.RunPod(id);
      FirstAnswer(staging);
    }
    const long after = RssKb(node.agent_pid());
    state.counters["rss_before_mib"] = before / 1024.0;
    state.counters["rss_after_mib"] = after / 1024.0;
    state.counters["added_kib_per_volume"] = static_cast<double>(after - before) / n;
  }
}
BENCHMARK(BM_AgentRssPerServerPodVolume)->Arg(100)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace fusekeeper

int main(int argc, char** argv) {
  PCHECK(unshare(CLONE_NEWNS) == 0) << "server_pod_bench needs root";
  PCHECK(mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
