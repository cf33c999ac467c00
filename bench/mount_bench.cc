// Mount-engine benchmarks, run in a private mount namespace with real mounts (as root):
//
//   bazel run -c opt //bench:mount_bench -- --benchmark_repetitions=5 \
//       --benchmark_report_aggregates_only=true
//
// Pairs to read as ratios:
//  - BM_ParseMountinfo/N vs BM_KernelReadMountinfo/N: our parse against the kernel's time to
//    produce the same N-mount table (target: parse <= 15 % of the read);
//  - BM_StatmountLookup/N vs BM_FullTableLookup/N: finding one mount by id vs read+parse+search;
//  - BM_PublishUnpublishRoundTrip (one client) reports the agent's own time per publish+unpublish
//    pair (agent_us_per_pair: server-side, dispatch to answer) to compare with BM_PairFloor, the
//    pair's bare syscalls + the three state writes crash safety needs (target <= 2x);
//  - BM_ProbeRoundTrip here vs csi_bench's BM_ProbeInlineBaseline: Probe against a minimal gRPC
//    callback server (target <= 1.1x);
//  - BM_PublishUnpublishBlocking: the pool threads' share of a pair (syscalls, state writes);
//  - BM_PublishUnpublishRoundTrip/threads:64: 64 concurrent clients, each on its own volume, pairs/s.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <linux/openat2.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "agent/csi/server.h"
#include "agent/base/unique_fd.h"
#include "agent/fuse/handoff_endpoint.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/loop/blocking_pool.h"
#include "agent/loop/loop.h"
#include "agent/mount/mount_ops.h"
#include "agent/mount/mountinfo.h"
#include "agent/mount/table_reader.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/sys/syscalls.h"
#include "agent/volume/state_store.h"
#include "agent/volume/fuse_kind.h"
#include "agent/volume/host_path_kind.h"
#include "agent/volume/volume_manager.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"
#include "proto/csi.grpc.pb.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;

std::string& Root() {
  static std::string root = [] {
    char tmpl[] = "/tmp/fk-mbench-XXXXXX";
    CHECK(mkdtemp(tmpl) != nullptr);
    CHECK_EQ(mount("tmpfs", tmpl, "tmpfs", 0, nullptr), 0);
    return std::string(tmpl);
  }();
  return root;
}

// Keeps exactly n extra bind mounts in this namespace.
void EnsureMounts(int n) {
  static int have = 0;
  const std::string src = Root() + "/src";
  fs::create_directories(src);
  for (; have < n; ++have) {
    std::string d = Root() + "/m" + std::to_string(have);
    fs::create_directories(d);
    PCHECK(mount(src.c_str(), d.c_str(), nullptr, MS_BIND, nullptr) == 0);
  }
  for (; have > n; --have) {
    std::string d = Root() + "/m" + std::to_string(have - 1);
    PCHECK(umount2(d.c_str(), 0) == 0);
  }
}

std::string ReadMountinfo(int fd) {
  std::string out;
  char buf[64 * 1024];
  off_t off = 0;
  while (true) {
    ssize_t n = pread(fd, buf, sizeof(buf), off);
    CHECK_GE(n, 0);
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    off += n;
  }
  return out;
}

void BM_KernelReadMountinfo(benchmark::State& state) {
  EnsureMounts(static_cast<int>(state.range(0)));
  int fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
  size_t lines = 0;
  for (auto _ : state) {
    std::string text = ReadMountinfo(fd);
    benchmark::DoNotOptimize(text.data());
    lines = std::count(text.begin(), text.end(), '\n');
  }
  close(fd);
  state.counters["lines"] = static_cast<double>(lines);
}
BENCHMARK(BM_KernelReadMountinfo)->Arg(1000)->Arg(5000)->Unit(benchmark::kMicrosecond);

void BM_ParseMountinfo(benchmark::State& state) {
  EnsureMounts(static_cast<int>(state.range(0)));
  int fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
  const std::string text = ReadMountinfo(fd);
  close(fd);
  for (auto _ : state) {
    auto table = MountTable::Parse(text);
    CHECK(table.ok());
    benchmark::DoNotOptimize(table->entries().data());
  }
  state.counters["lines"] = static_cast<double>(std::count(text.begin(), text.end(), '\n'));
}
BENCHMARK(BM_ParseMountinfo)->Arg(1000)->Arg(5000)->Unit(benchmark::kMicrosecond);

void BM_FullTableLookup(benchmark::State& state) {
  EnsureMounts(static_cast<int>(state.range(0)));
  const std::string target = Root() + "/m" + std::to_string(state.range(0) - 1);
  int fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
  for (auto _ : state) {
    auto table = MountTable::Parse(ReadMountinfo(fd));
    CHECK(table.ok());
    CHECK(table->FindTop(target) != nullptr);
  }
  close(fd);
}
BENCHMARK(BM_FullTableLookup)->Arg(1000)->Arg(5000)->Unit(benchmark::kMicrosecond);

void BM_StatmountLookup(benchmark::State& state) {
  if (!sys::HaveStatmount()) {
    state.SkipWithError("kernel lacks statmount (6.8+)");
    return;
  }
  EnsureMounts(static_cast<int>(state.range(0)));
  const std::string target = Root() + "/m" + std::to_string(state.range(0) - 1);
  int fd = open(target.c_str(), O_PATH | O_CLOEXEC);
  for (auto _ : state) {
    uint64_t id = 0;
    CHECK_EQ(sys::StatxUniqueMountId(fd, "", &id), 0);
    sys::MountFacts facts;
    CHECK_EQ(sys::StatMount(id, &facts), 0);
    CHECK(facts.mount_point == target);
  }
  close(fd);
}
BENCHMARK(BM_StatmountLookup)->Arg(1000)->Arg(5000)->Unit(benchmark::kMicrosecond);

// The agent, in process: loop, pool, volume manager, CSI server; one staged host-path volume.
struct Agent {
  std::unique_ptr<Loop> loop;
  std::thread loop_thread;
  std::unique_ptr<BlockingPool> pool;
  std::unique_ptr<KubeletDir> kubelet;
  std::unique_ptr<StateStore> store;
  std::unique_ptr<MountTableReader> reader;
  std::unique_ptr<VolumeManager> volumes;
  std::unique_ptr<CsiServer> server;
  std::shared_ptr<grpc::Channel> channel;
  // The agent's own time for publish/unpublish RPCs: from gRPC handing the call over to the
  // answer (RpcDispatcher's observer), summed. Excludes gRPC's transport both ways.
  std::atomic<int64_t> pair_rpc_ns{0};
};

Agent& TheAgent() {
  static Agent* agent = [] {
    EnsureMounts(0);
    auto* a = new Agent();
    const std::string kubelet = Root() + "/kubelet";
    fs::create_directories(kubelet + "/pods");
    fs::create_directories(Root() + "/data");
    a->loop = std::move(*Loop::Create());
    a->pool = std::make_unique<BlockingPool>(*a->loop, BlockingPoolOptions{.threads = 4});
    a->kubelet = std::make_unique<KubeletDir>(std::move(*KubeletDir::Open(kubelet)));
    a->store = std::make_unique<StateStore>(std::move(*StateStore::Open(Root() + "/state")));
    a->reader = std::move(*MountTableReader::Create(*a->loop));
    a->volumes = std::make_unique<VolumeManager>(*a->loop, *a->pool, *a->kubelet, *a->store, *a->reader,
                                                 VolumeManagerOptions{.stats_timeout = absl::Seconds(1)});
    a->volumes->AddKind(std::make_unique<HostPathKind>(*a->volumes));
    a->volumes->AddKind(
        std::make_unique<FuseKind>(*a->volumes, FuseKindOptions{.socket_dir = Root() + "/state/sockets"}));
    CsiServerOptions options;
    options.endpoint = "unix://" + Root() + "/csi.sock";
    options.identity.driver_name = "fusekeeper.csi";
    options.node.node_id = "bench";
    options.rpc_observer = [a](const char* method, absl::StatusCode, absl::Duration latency) {
      if (std::string_view(method) == "NodePublishVolume" || std::string_view(method) == "NodeUnpublishVolume") {
        a->pair_rpc_ns += absl::ToInt64Nanoseconds(latency);
      }
    };
    a->server = std::move(*CsiServer::Start(*a->loop, options, a->volumes.get()));
    a->loop_thread = std::thread([a] { a->loop->Run(); });
    std::promise<absl::Status> started;
    a->loop->Post([&] { a->volumes->Start([&](absl::Status s) { started.set_value(s); }); });
    CHECK(started.get_future().get().ok());
    a->channel = grpc::CreateChannel("unix:" + Root() + "/csi.sock", grpc::InsecureChannelCredentials());
    return a;
  }();
  return *agent;
}

// Stages host-path volume `id` (once) and returns its staging path.
std::string StagedVolume(const std::string& id) {
  static std::mutex mu;
  static std::set<std::string> staged;
  Agent& a = TheAgent();
  const std::string staging = Root() + "/kubelet/plugins/" + id + "/globalmount";
  std::lock_guard<std::mutex> lock(mu);
  if (staged.count(id)) return staging;
  fs::create_directories(staging);
  csi::v1::NodeStageVolumeRequest r;
  r.set_volume_id(id);
  r.set_staging_target_path(staging);
  r.mutable_volume_capability()->mutable_mount();
  r.mutable_volume_capability()->mutable_access_mode()->set_mode(
      csi::v1::VolumeCapability::AccessMode::MULTI_NODE_MULTI_WRITER);
  (*r.mutable_volume_context())["kind"] = "hostPath";
  (*r.mutable_volume_context())["path"] = Root() + "/data";
  csi::v1::NodeStageVolumeResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = csi::v1::Node::NewStub(a.channel)->NodeStageVolume(&ctx, r, &resp);
  CHECK(s.ok()) << s.error_message();
  staged.insert(id);
  return staging;
}

// NodePublishVolume of staged volume `id` at `target`, as kubelet sends it.
csi::v1::NodePublishVolumeRequest PublishRequest(const std::string& id, const std::string& staging,
                                                 const std::string& target) {
  csi::v1::NodePublishVolumeRequest pub;
  pub.set_volume_id(id);
  pub.set_staging_target_path(staging);
  pub.set_target_path(target);
  pub.mutable_volume_capability()->mutable_mount();
  pub.mutable_volume_capability()->mutable_access_mode()->set_mode(
      csi::v1::VolumeCapability::AccessMode::MULTI_NODE_MULTI_WRITER);
  return pub;
}

// The floor of a publish+unpublish pair: the syscalls the agent's pair cannot do without, done
// bare on this thread. Publish: open the staged source and the target beneath the kubelet dir
// (openat2, no symlinks), clone the source (open_tree), make the clone follow the global mount
// (mount_setattr slave, then shared), attach it (move_mount); unpublish: umount2. Plus the three
// state writes crash safety needs (publish intent, publish done, unpublish done; volume_ops.cc).
// No checks, no identity lookups.
void BM_PairFloor(benchmark::State& state) {
  {
    Agent& a = TheAgent();
    const std::string staging = StagedVolume("floor-src");
    const std::string parent = Root() + "/kubelet/pods/floor/volumes/kubernetes.io~csi/v";
    fs::create_directories(parent + "/mount");
    int kubelet_fd = open((Root() + "/kubelet").c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    PCHECK(kubelet_fd >= 0);
    const std::string source_rel = "plugins/floor-src/globalmount";
    const std::string target_rel = "pods/floor/volumes/kubernetes.io~csi/v/mount";
    const std::string target = parent + "/mount";
    state::Volume v;
    v.set_volume_id("floor");
    v.set_staging_path(staging);
    for (auto _ : state) {
      state::Volume with = v;
      with.add_targets()->set_path(target);
      with.mutable_targets(0)->set_pending(true);
      CHECK(a.store->SaveBlocking(with).ok());
      UniqueFd source(sys::OpenAt2(kubelet_fd, source_rel.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC, 0,
                                   RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS));
      UniqueFd dst(sys::OpenAt2(kubelet_fd, target_rel.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC, 0,
                                RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS));
      PCHECK(source && dst);
      BindOptions bind;
      bind.follow_source = true;
      CHECK(BindMountFdBlocking(source.get(), dst.get(), bind, staging, target).ok());
      with.mutable_targets(0)->set_pending(false);
      CHECK(a.store->SaveBlocking(with).ok());
      PCHECK(umount2(target.c_str(), UMOUNT_NOFOLLOW) == 0);
      CHECK(a.store->SaveBlocking(v).ok());
    }
    close(kubelet_fd);
    CHECK(a.store->RemoveBlocking("floor").ok());
  }
}
BENCHMARK(BM_PairFloor)->UseRealTime()->Unit(benchmark::kMicrosecond);

// Each client (thread) publishes and unpublishes its own volume, as kubelets do for different pods.
// Single client: agent_us_per_pair is the agent's own time per pair (dispatch to answer, summed
// over both RPCs), to compare with BM_PairFloor (target: at most 2x).
void BM_PublishUnpublishRoundTrip(benchmark::State& state) {
  Agent& a = TheAgent();
  if (state.thread_index() == 0) a.pair_rpc_ns = 0;
  const std::string id = "bench-" + std::to_string(state.thread_index());
  const std::string staging = StagedVolume(id);
  auto stub = csi::v1::Node::NewStub(a.channel);
  const std::string parent =
      Root() + "/kubelet/pods/p" + std::to_string(state.thread_index()) + "/volumes/kubernetes.io~csi/v";
  fs::create_directories(parent);
  const csi::v1::NodePublishVolumeRequest pub = PublishRequest(id, staging, parent + "/mount");
  csi::v1::NodeUnpublishVolumeRequest unpub;
  unpub.set_volume_id(id);
  unpub.set_target_path(parent + "/mount");
  int64_t aborted = 0;
  for (auto _ : state) {
    // Never expected (one client per volume); counted, and retried as kubelet would.
    while (true) {
      grpc::ClientContext c;
      csi::v1::NodePublishVolumeResponse r;
      grpc::Status s = stub->NodePublishVolume(&c, pub, &r);
      if (s.ok()) break;
      CHECK(s.error_code() == grpc::ABORTED) << s.error_message();
      ++aborted;
    }
    while (true) {
      grpc::ClientContext c;
      csi::v1::NodeUnpublishVolumeResponse r;
      grpc::Status s = stub->NodeUnpublishVolume(&c, unpub, &r);
      if (s.ok()) break;
      CHECK(s.error_code() == grpc::ABORTED) << s.error_message();
      ++aborted;
    }
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["aborted_retries"] = benchmark::Counter(static_cast<double>(aborted), benchmark::Counter::kAvgIterations);
  if (state.threads() == 1 && state.iterations() > 0) {
    const double own_us = static_cast<double>(a.pair_rpc_ns.load()) / 1000.0 / static_cast<double>(state.iterations());
    state.counters["agent_us_per_pair"] = own_us;
  }
}
BENCHMARK(BM_PublishUnpublishRoundTrip)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PublishUnpublishRoundTrip)->Threads(64)->UseRealTime()->Unit(benchmark::kMicrosecond);

// Kubelet mounts a shared volume for many pods at once (a Deployment's replicas on one node):
// N NodePublish calls of one staged volume, each to its own target, issued together, each
// retried with kubelet's backoff (500 ms doubling, up to 2 min 2 s) on any error. Time until all
// are OK, and how many retries that took. Baseline (from the issue, same client):
// csi-driver-host-path answers 50 in 0.49 s.
// Second argument 1: the same storm against N distinct volumes (one per pod), for comparison.
void BM_KubeletStorm(benchmark::State& state) {
  Agent& a = TheAgent();
  const int n = static_cast<int>(state.range(0));
  const bool distinct = state.range(1) != 0;
  std::vector<std::string> ids, stagings, targets;
  for (int i = 0; i < n; ++i) {
    ids.push_back(distinct ? "storm-" + std::to_string(i) : "storm");
    stagings.push_back(StagedVolume(ids.back()));
    const std::string parent = Root() + "/kubelet/pods/storm" + std::to_string(i) + "/volumes/kubernetes.io~csi/v";
    fs::create_directories(parent);
    targets.push_back(parent + "/mount");
  }
  std::atomic<int64_t> retries{0};
  for (auto _ : state) {
    std::vector<std::thread> pods;
    for (int i = 0; i < n; ++i) {
      pods.emplace_back([&, i] {
        auto stub = csi::v1::Node::NewStub(a.channel);
        const size_t k = static_cast<size_t>(i);
        const csi::v1::NodePublishVolumeRequest pub = PublishRequest(ids[k], stagings[k], targets[k]);
        auto backoff = std::chrono::milliseconds(500);
        while (true) {
          grpc::ClientContext c;
          csi::v1::NodePublishVolumeResponse r;
          if (stub->NodePublishVolume(&c, pub, &r).ok()) return;
          ++retries;
          std::this_thread::sleep_for(backoff);  // kubelet's exponential backoff (the model)
          backoff = std::min(backoff * 2, std::chrono::milliseconds(122000));
        }
      });
    }
    for (auto& p : pods) p.join();
    state.PauseTiming();
    auto stub = csi::v1::Node::NewStub(a.channel);
    for (size_t k = 0; k < targets.size(); ++k) {
      csi::v1::NodeUnpublishVolumeRequest unpub;
      unpub.set_volume_id(ids[k]);
      unpub.set_target_path(targets[k]);
      grpc::ClientContext c;
      csi::v1::NodeUnpublishVolumeResponse r;
      CHECK(stub->NodeUnpublishVolume(&c, unpub, &r).ok());
    }
    state.ResumeTiming();
  }
  state.counters["retries_per_storm"] =
      benchmark::Counter(static_cast<double>(retries.load()), benchmark::Counter::kAvgIterations);
}
BENCHMARK(BM_KubeletStorm)
    ->ArgsProduct({{10, 50, 110}, {0, 1}})
    ->ArgNames({"pods", "distinct"})
    ->Iterations(5)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_ProbeRoundTrip(benchmark::State& state) {
  Agent& a = TheAgent();
  auto stub = csi::v1::Identity::NewStub(a.channel);
  for (auto _ : state) {
    grpc::ClientContext c;
    csi::v1::ProbeResponse r;
    CHECK(stub->Probe(&c, {}, &r).ok());
  }
}
BENCHMARK(BM_ProbeRoundTrip)->UseRealTime()->Unit(benchmark::kMicrosecond);

// Probe's path plus one loop -> pool -> loop crossing (statfs on the pool): the crossing's cost.
void BM_StatsRoundTrip(benchmark::State& state) {
  Agent& a = TheAgent();
  const std::string staging = StagedVolume("bench");
  auto stub = csi::v1::Node::NewStub(a.channel);
  csi::v1::NodeGetVolumeStatsRequest r;
  r.set_volume_id("bench");
  r.set_volume_path(staging);
  for (auto _ : state) {
    grpc::ClientContext c;
    csi::v1::NodeGetVolumeStatsResponse resp;
    grpc::Status s = stub->NodeGetVolumeStats(&c, r, &resp);
    CHECK(s.ok() && !resp.volume_condition().abnormal()) << s.error_message();
  }
}
BENCHMARK(BM_StatsRoundTrip)->UseRealTime()->Unit(benchmark::kMicrosecond);

// The blocking halves alone (what the pool threads run per pair): no gRPC, no loop, no hops.
void BM_PublishUnpublishBlocking(benchmark::State& state) {
  Agent& a = TheAgent();
  StagedVolume("bench");
  VolumeOpsContext ctx{a.kubelet.get(), a.store.get()};
  std::vector<state::Volume> loaded;
  std::vector<std::string> problems;
  auto all = a.store->LoadAllBlocking(&problems);
  CHECK(all.ok()) << all.status();
  for (auto& v : *all) {
    if (v.volume_id() == "bench") loaded.push_back(v);
  }
  CHECK_EQ(loaded.size(), 1u);
  const std::string parent = Root() + "/kubelet/pods/blocking/volumes/kubernetes.io~csi/v";
  fs::create_directories(parent);
  for (auto _ : state) {
    state::Volume v = loaded[0];
    auto* t = v.add_targets();
    t->set_path(parent + "/mount");
    auto source = OpenStagingMountBlocking(ctx, v);
    CHECK(source.ok()) << source.status();
    auto published = PublishBlocking(ctx, v, v.targets_size() - 1, loaded[0], BindOptions{}, std::move(*source));
    CHECK(published.ok()) << published.status();
    auto left = UnpublishBlocking(ctx, *published, parent + "/mount");
    CHECK(left.ok()) << left.status();
  }
}
BENCHMARK(BM_PublishUnpublishBlocking)->UseRealTime()->Unit(benchmark::kMicrosecond);

// ---- FUSE (issue 4) ----

// Handoff latency: a server connects to a fresh endpoint and has the fd (server side timing).
void BM_HandoffConnectToFd(benchmark::State& state) {
  Agent& a = TheAgent();
  const std::string dir = Root() + "/handoff";
  fs::create_directories(dir);
  UniqueFd dir_fd(open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  for (auto _ : state) {
    state.PauseTiming();
    auto listen = HandoffEndpoint::ListenBlocking(dir_fd.get(), "s", 0, 0);
    CHECK(listen.ok());
    std::shared_ptr<HandoffEndpoint> ep;
    std::promise<void> started;
    a.loop->Post([&] {
      ep = HandoffEndpoint::Start(*a.loop, std::move(*listen), UniqueFd(open("/dev/null", O_RDWR | O_CLOEXEC)),
                                  {.volume_id = "bench"}, {}, {});
      started.set_value();
    });
    started.get_future().wait();
    state.ResumeTiming();
    UniqueFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, (dir + "/s").c_str(), sizeof(addr.sun_path) - 1);
    CHECK_EQ(connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    auto m = ReceiveHandoffMessage(s.get());
    CHECK(m.ok() && m->fd.valid());
    state.PauseTiming();
    CHECK(SendHandoffMessage(s.get(), EncodeHandoffReply({.ok = true}), -1).ok());
    std::promise<void> stopped;
    a.loop->Post([&] {
      ep->Stop();
      ep.reset();
      stopped.set_value();
    });
    stopped.get_future().wait();
    state.ResumeTiming();
  }
}
BENCHMARK(BM_HandoffConnectToFd)->UseRealTime()->Unit(benchmark::kMicrosecond);

// Baseline: one message with an fd over an already-connected socketpair.
void BM_BareScmRights(benchmark::State& state) {
  int sv[2];
  CHECK_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]), devnull(open("/dev/null", O_RDWR | O_CLOEXEC));
  for (auto _ : state) {
    CHECK(SendHandoffMessage(a.get(), "{}", devnull.get()).ok());
    auto m = ReceiveHandoffMessage(b.get());
    CHECK(m.ok());
  }
}
BENCHMARK(BM_BareScmRights)->UseRealTime()->Unit(benchmark::kMicrosecond);

// A pod directory with an emptyDir "fk" and a target for volume `vol`; returns the target.
std::string BenchPod(const std::string& uid, const std::string& vol) {
  const std::string pod = Root() + "/kubelet/pods/" + uid;
  fs::create_directories(pod + "/volumes/kubernetes.io~empty-dir/fk");
  fs::create_directories(pod + "/volumes/kubernetes.io~csi/" + vol);
  return pod + "/volumes/kubernetes.io~csi/" + vol + "/mount";
}

csi::v1::NodePublishVolumeRequest FuseInlinePublish(const std::string& id, const std::string& pod,
                                                    const std::string& target) {
  csi::v1::NodePublishVolumeRequest r;
  r.set_volume_id(id);
  r.set_target_path(target);
  r.mutable_volume_capability()->mutable_mount();
  r.mutable_volume_capability()->mutable_access_mode()->set_mode(
      csi::v1::VolumeCapability::AccessMode::SINGLE_NODE_WRITER);
  auto& ctx = *r.mutable_volume_context();
  ctx["kind"] = "fuse";
  ctx["socketVolume"] = "fk";
  ctx["csi.storage.k8s.io/pod.uid"] = pod;
  return r;
}

// NodePublish + NodeUnpublish of an inline FUSE volume (mount /dev/fuse, socket; abort, unmount)
// next to BM_PublishUnpublishRoundTrip (a host-path bind).
void BM_PublishUnpublishFuseInline(benchmark::State& state) {
  Agent& a = TheAgent();
  auto stub = csi::v1::Node::NewStub(a.channel);
  const std::string target = BenchPod("fuse-pod", "v");
  auto pub = FuseInlinePublish("fuse-bench", "fuse-pod", target);
  csi::v1::NodeUnpublishVolumeRequest unpub;
  unpub.set_volume_id("fuse-bench");
  unpub.set_target_path(target);
  for (auto _ : state) {
    grpc::ClientContext c1, c2;
    csi::v1::NodePublishVolumeResponse r1;
    csi::v1::NodeUnpublishVolumeResponse r2;
    grpc::Status s = stub->NodePublishVolume(&c1, pub, &r1);
    CHECK(s.ok()) << s.error_message();
    s = stub->NodeUnpublishVolume(&c2, unpub, &r2);
    CHECK(s.ok()) << s.error_message();
  }
}
BENCHMARK(BM_PublishUnpublishFuseInline)->UseRealTime()->Unit(benchmark::kMicrosecond);

// A "server" that takes the fd, says ok, and never answers a FUSE request: a hung volume.
struct HungServer {
  UniqueFd socket;
  UniqueFd fuse_fd;
};

// 1000 mixed RPCs on healthy volumes (Probe, NodeGetInfo, stats of a host-path volume, publish +
// unpublish of a host-path target), with range(0) hung FUSE volumes on the node whose stats are
// polled along the way, as kubelet polls every volume. Reports the healthy RPCs' p50/p99.
void BM_MixedRpcs(benchmark::State& state) {
  Agent& a = TheAgent();
  auto node = csi::v1::Node::NewStub(a.channel);
  auto identity = csi::v1::Identity::NewStub(a.channel);
  const int hung = static_cast<int>(state.range(0));
  std::vector<HungServer> servers;
  std::vector<std::pair<std::string, std::string>> hung_volumes;  // id, target
  for (int i = 0; i < hung; ++i) {
    const std::string id = "hung-" + std::to_string(i), pod = "hung-pod-" + std::to_string(i);
    const std::string target = BenchPod(pod, "v");
    grpc::ClientContext c;
    csi::v1::NodePublishVolumeResponse r;
    grpc::Status s = node->NodePublishVolume(&c, FuseInlinePublish(id, pod, target), &r);
    CHECK(s.ok()) << s.error_message();
    HungServer h;
    h.socket.Reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string sock = Root() + "/kubelet/pods/" + pod + "/volumes/kubernetes.io~empty-dir/fk/fusekeeper.sock";
    strncpy(addr.sun_path, sock.c_str(), sizeof(addr.sun_path) - 1);
    CHECK_EQ(connect(h.socket.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    auto m = ReceiveHandoffMessage(h.socket.get());
    CHECK(m.ok() && m->fd.valid());
    h.fuse_fd = std::move(m->fd);
    CHECK(SendHandoffMessage(h.socket.get(), EncodeHandoffReply({.ok = true}), -1).ok());
    servers.push_back(std::move(h));
    hung_volumes.push_back({id, target});
  }
  const std::string staging = StagedVolume("bench");
  const std::string target = BenchPod("mixed", "v");
  const csi::v1::NodePublishVolumeRequest pub = PublishRequest("bench", staging, target);
  csi::v1::NodeUnpublishVolumeRequest unpub;
  unpub.set_volume_id("bench");
  unpub.set_target_path(target);
  csi::v1::NodeGetVolumeStatsRequest stats;
  stats.set_volume_id("bench");
  stats.set_volume_path(staging);
  std::vector<double> latencies_us;
  std::vector<double> by_kind[5];
  for (auto _ : state) {
    latencies_us.clear();
    for (auto& k : by_kind) k.clear();
    for (int i = 0; i < 1000; ++i) {
      if (hung > 0 && i % 10 == 0) {  // kubelet's stats poll reaches the hung volumes too
        const auto& [id, hung_target] = hung_volumes[(i / 10) % hung];
        csi::v1::NodeGetVolumeStatsRequest hs;
        hs.set_volume_id(id);
        hs.set_volume_path(hung_target);
        grpc::ClientContext c;
        c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
        csi::v1::NodeGetVolumeStatsResponse r;
        node->NodeGetVolumeStats(&c, hs, &r);
      }
      auto start = std::chrono::steady_clock::now();
      grpc::ClientContext c;
      grpc::Status s;
      switch (i % 5) {
        case 0: {
          csi::v1::ProbeResponse r;
          s = identity->Probe(&c, {}, &r);
          break;
        }
        case 1: {
          csi::v1::NodeGetInfoResponse r;
          s = node->NodeGetInfo(&c, {}, &r);
          break;
        }
        case 2: {
          csi::v1::NodeGetVolumeStatsResponse r;
          s = node->NodeGetVolumeStats(&c, stats, &r);
          break;
        }
        case 3: {
          csi::v1::NodePublishVolumeResponse r;
          s = node->NodePublishVolume(&c, pub, &r);
          break;
        }
        case 4: {
          csi::v1::NodeUnpublishVolumeResponse r;
          s = node->NodeUnpublishVolume(&c, unpub, &r);
          break;
        }
      }
      CHECK(s.ok()) << s.error_message();
      const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      latencies_us.push_back(us);
      by_kind[i % 5].push_back(us);
    }
  }
  std::sort(latencies_us.begin(), latencies_us.end());
  state.counters["p50_us"] = latencies_us[latencies_us.size() / 2];
  state.counters["p99_us"] = latencies_us[latencies_us.size() * 99 / 100];
  const char* kKinds[5] = {"probe", "info", "stats", "publish", "unpublish"};
  for (int k = 0; k < 5; ++k) {
    std::sort(by_kind[k].begin(), by_kind[k].end());
    state.counters[absl::StrCat(kKinds[k], "_p99_us")] = by_kind[k][by_kind[k].size() * 99 / 100];
  }
  // Tear the hung volumes down (abort + unmount) so later benchmarks start clean.
  for (const auto& [id, hung_target] : hung_volumes) {
    csi::v1::NodeUnpublishVolumeRequest r;
    r.set_volume_id(id);
    r.set_target_path(hung_target);
    grpc::ClientContext c;
    csi::v1::NodeUnpublishVolumeResponse resp;
    CHECK(node->NodeUnpublishVolume(&c, r, &resp).ok());
  }
}
BENCHMARK(BM_MixedRpcs)->Arg(0)->Arg(8)->Iterations(1)->UseRealTime()->Unit(benchmark::kMillisecond);

// The floor: the syscalls a bind publish + unpublish cannot avoid.
void BM_BareBindUnmount(benchmark::State& state) {
  const std::string src = Root() + "/bare-src", dst = Root() + "/bare-dst";
  fs::create_directories(src);
  fs::create_directories(dst);
  for (auto _ : state) {
    PCHECK(mount(src.c_str(), dst.c_str(), nullptr, MS_BIND, nullptr) == 0);
    PCHECK(umount2(dst.c_str(), 0) == 0);
  }
}
BENCHMARK(BM_BareBindUnmount)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fusekeeper

int main(int argc, char** argv) {
  // A private mount namespace before any thread exists: nothing here touches the host's mounts.
  PCHECK(unshare(CLONE_NEWNS) == 0) << "mount_bench needs root";
  PCHECK(mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0);
  // As the agent's main() does: Debian's abseil has deadlock detection on by default.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
