// Recovery's numbers (one run, compared side by side):
//  - BM_HealTargets/100: the global mount is back (a fresh mount on the staging path) → every one
//    of 100 pod targets re-bound onto it AND checked through it (statfs), as RebindTargetsBlocking
//    and Verify do. p50/p99 over the iterations are reported as counters. Against Fluid's 5 s
//    polling period.
//  - BM_DetectMountChange: a mount in the namespace → POLLPRI on /proc/self/mountinfo wakes a
//    ring waiter (the detection half).
//  - BM_ParsePodList/110: the kubelet's PodList of 110 pods (the default max pods per node).
//  - BM_AgentRss: the agent's RSS idle and with N volumes in its state (a counter, in MiB).
// Runs in a private mount namespace of its own (tmpfs mounts stand in for FUSE mounts: the
// re-bind work is the same, and no FUSE server's speed is measured).
#include <fcntl.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "agent/kubelet/pod_list.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/volume/fuse_volume_ops.h"
#include "agent/volume/state_store.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;

std::string Root() {
  static const std::string root = [] {
    char t[] = "/tmp/fk-recovery-bench-XXXXXX";
    std::string r = mkdtemp(t);
    PCHECK(mount("tmpfs", r.c_str(), "tmpfs", 0, "size=64m") == 0);
    return r;
  }();
  return root;
}

state::MountIdentity TopIdentity(const std::string& path) {
  struct stat st;
  PCHECK(stat(path.c_str(), &st) == 0);
  state::MountIdentity id;
  id.set_dev_major(major(st.st_dev));
  id.set_dev_minor(minor(st.st_dev));
  id.set_root("/");
  return id;
}

int MountCount(const std::string& path) {
  std::ifstream in("/proc/self/mountinfo");
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(" " + path + " ") != std::string::npos;
  return n;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

void BM_HealTargets(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const std::string kubelet = Root() + "/kubelet";
  const std::string staging = kubelet + "/plugins/fk/vol/globalmount";
  fs::create_directories(staging);
  auto kd = KubeletDir::Open(kubelet);
  CHECK(kd.ok()) << kd.status();
  auto store = StateStore::Open(Root() + "/state");
  CHECK(store.ok()) << store.status();
  VolumeOpsContext ctx{&*kd, &*store};
  PCHECK(mount("tmpfs", staging.c_str(), "tmpfs", 0, "size=1m") == 0);
  state::Volume v;
  v.set_volume_id("vol");
  v.set_kind("fuse");
  v.set_staging_path(staging);
  *v.mutable_staging_mount() = TopIdentity(staging);
  for (int i = 0; i < n; ++i) {
    const std::string t = absl::StrCat(kubelet, "/pods/p", i, "/volumes/kubernetes.io~csi/vol/mount");
    fs::create_directories(t);
    PCHECK(mount(staging.c_str(), t.c_str(), nullptr, MS_BIND, nullptr) == 0);
    state::Target* target = v.add_targets();
    target->set_path(t);
    *target->mutable_mount() = TopIdentity(t);
  }
  std::vector<double> micros;
  for (auto _ : state) {
    state.PauseTiming();
    // A fresh global connection is stacked on the global mount's base, as RemountFuseBlocking
    // does (the previous one removed first); the pod targets, private here so that nothing
    // propagates, are back on their bases, as after their dead layers were removed. The timed
    // part stacks a bind of the live global mount on each target.
    for (const auto& t : v.targets()) {
      if (MountCount(t.path()) > 1) PCHECK(umount2(t.path().c_str(), MNT_DETACH) == 0);
    }
    if (MountCount(staging) > 1) PCHECK(umount2(staging.c_str(), MNT_DETACH) == 0);
    PCHECK(mount("tmpfs", staging.c_str(), "tmpfs", 0, "size=1m") == 0);
    *v.mutable_staging_mount() = TopIdentity(staging);
    state.ResumeTiming();
    const auto start = std::chrono::steady_clock::now();
    auto out = RebindTargetsBlocking(ctx, v);
    CHECK(out.ok()) << out.status();
    CHECK_EQ(static_cast<int>(out->rebound.size()), n) << (out->failed.empty() ? "" : out->failed[0]);
    // Healed only when a check through the new mount succeeds.
    for (const auto& t : out->volume.targets()) {
      struct statfs sf;
      PCHECK(statfs(t.path().c_str(), &sf) == 0);
    }
    micros.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    v = std::move(out->volume);
  }
  state.counters["p50_ms"] = Percentile(micros, 0.50) / 1000;
  state.counters["p99_ms"] = Percentile(micros, 0.99) / 1000;
  state.counters["vs_fluid_5s_period"] = Percentile(micros, 0.99) / 5e6;
  for (const auto& t : v.targets()) umount2(t.path().c_str(), MNT_DETACH);
  umount2(staging.c_str(), MNT_DETACH);
}
BENCHMARK(BM_HealTargets)->Arg(100)->Iterations(200)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_DetectMountChange(benchmark::State& state) {
  const std::string dir = Root() + "/detect";
  fs::create_directories(dir);
  int fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
  pollfd p{fd, POLLPRI, 0};
  poll(&p, 1, 0);  // consume any earlier change
  for (auto _ : state) {
    PCHECK(mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") == 0);
    p.revents = 0;
    PCHECK(poll(&p, 1, 1000) == 1);
    state.PauseTiming();
    umount2(dir.c_str(), MNT_DETACH);
    poll(&p, 1, 1000);
    state.ResumeTiming();
  }
  close(fd);
}
BENCHMARK(BM_DetectMountChange)->UseRealTime()->Unit(benchmark::kMicrosecond);

std::string PodListJson(int pods) {
  std::string items;
  for (int i = 0; i < pods; ++i) {
    absl::StrAppend(
        &items, i ? "," : "",
        R"({"metadata":{"name":"app-)", i, R"(","namespace":"default","uid":"7c9e6679-7425-40de-944b-e07fc1f9)", 1000 + i,
        R"(","labels":{"app":"demo","tier":"backend"},"annotations":{"kubernetes.io/config.seen":"2026-11-21T10:00:00Z"}},)",
        R"("spec":{"nodeName":"node-1","containers":[{"name":"app","image":"registry.example/app:1.2.3","resources":{"requests":{"cpu":"100m","memory":"128Mi"}}}]},)",
        R"("status":{"phase":"Running","podIP":"10.0.0.)", i % 250, R"(","conditions":[{"type":"Ready","status":"True"}],)",
        R"("containerStatuses":[{"name":"app","ready":true,"restartCount":0,"image":"registry.example/app:1.2.3","containerID":"containerd://)",
        std::string(64, 'a'), R"(","state":{"running":{"startedAt":"2026-11-21T10:00:02Z"}}}],)",
        R"("initContainerStatuses":[{"name":"fuse","ready":true,"restartCount":2,"containerID":"containerd://)", std::string(64, 'b'),
        R"(","state":{"running":{"startedAt":"2026-11-21T10:00:01Z"}},"lastState":{"terminated":{"exitCode":137,"reason":"Error"}}}]}})");
  }
  return absl::StrCat(R"({"kind":"PodList","apiVersion":"v1","metadata":{},"items":[)", items, "]}");
}

void BM_ParsePodList(benchmark::State& state) {
  const std::string json = PodListJson(static_cast<int>(state.range(0)));
  RestartDetector detector;
  for (auto _ : state) {
    auto pods = ParsePodList(json);
    CHECK(pods.ok());
    benchmark::DoNotOptimize(detector.Update(*pods));
  }
  state.counters["json_kib"] = json.size() / 1024.0;
}
BENCHMARK(BM_ParsePodList)->Arg(110)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fusekeeper

int main(int argc, char** argv) {
  PCHECK(unshare(CLONE_NEWNS) == 0) << "recovery_bench needs root";
  PCHECK(mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0);
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
