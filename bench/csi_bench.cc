// CSI RPC benchmarks over a real Unix socket with a real gRPC client.
//
//   bazel run -c opt //bench:csi_bench -- --benchmark_repetitions=10 \
//       --benchmark_report_aggregates_only=true
//
// BM_ProbeFusekeeper: fusekeeper's CSI server answering Probe (on gRPC's thread, checking the
// loop's liveness without a hop to it). BM_ProbeInlineBaseline: a minimal gRPC callback server
// answering the same RPC on the same kind of socket, i.e. the floor gRPC itself sets (target:
// at most 1.1x).
#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "agent/csi/server.h"
#include "agent/loop/loop.h"
#include "absl/synchronization/mutex.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"
#include "proto/csi.grpc.pb.h"

namespace fusekeeper {
namespace {

std::string TempDir() {
  char tmpl[] = "/tmp/fk-bench-XXXXXX";
  CHECK(mkdtemp(tmpl) != nullptr);
  return tmpl;
}

void ProbeLoop(benchmark::State& state, const std::string& socket) {
  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  auto stub = csi::v1::Identity::NewStub(channel);
  for (auto _ : state) {
    grpc::ClientContext ctx;
    csi::v1::ProbeResponse resp;
    grpc::Status s = stub->Probe(&ctx, {}, &resp);
    if (!s.ok() || !resp.ready().value()) state.SkipWithError("Probe failed");
  }
}

void BM_ProbeFusekeeper(benchmark::State& state) {
  const std::string dir = TempDir();
  auto loop = Loop::Create();
  CHECK(loop.ok());
  std::thread runner([&] { (*loop)->Run(); });
  CsiServerOptions options;
  options.endpoint = "unix://" + dir + "/csi.sock";
  options.identity.driver_name = "fusekeeper.csi";
  options.node.node_id = "bench";
  auto server = CsiServer::Start(**loop, options);
  CHECK(server.ok()) << server.status();
  ProbeLoop(state, (*server)->socket_path());
  (*server)->Shutdown(absl::Seconds(5));
  (*loop)->Stop();
  runner.join();
  std::filesystem::remove_all(dir);
}
BENCHMARK(BM_ProbeFusekeeper)->UseRealTime();

class InlineIdentity final : public csi::v1::Identity::CallbackService {
  grpc::ServerUnaryReactor* Probe(grpc::CallbackServerContext* ctx, const csi::v1::ProbeRequest*,
                                  csi::v1::ProbeResponse* resp) override {
    resp->mutable_ready()->set_value(true);
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

void BM_ProbeInlineBaseline(benchmark::State& state) {
  const std::string dir = TempDir();
  const std::string socket = dir + "/csi.sock";
  InlineIdentity service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  CHECK(server != nullptr);
  ProbeLoop(state, socket);
  server->Shutdown(std::chrono::system_clock::now());
  std::filesystem::remove_all(dir);
}
BENCHMARK(BM_ProbeInlineBaseline)->UseRealTime();

// As the agent's main() does: Debian's abseil has absl::Mutex deadlock detection on by default.
const bool kNoDeadlockDetection = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

}  // namespace
}  // namespace fusekeeper
