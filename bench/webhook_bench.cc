// The admission webhook's latency and memory, side by side with the agent's metrics server (the
// other small HTTP server of this project), in one run:
//
//   bazel run -c opt //bench:webhook_bench
//
// BM_WebhookReview/*: 1000 AdmissionReviews of a pod with an inline FUSE volume and opt-in
// injection (the largest patch the webhook makes), over one kept-alive TLS connection, over a new
// TLS connection each, and from 8 clients at once; p50/p99 in µs as counters. BM_AgentMetrics:
// GET /metrics from the agent over one kept-alive connection. BM_Rss: both processes' RSS after
// the run.
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "agent/webhook/certs.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"
#include "tests/webhook/recorded_pods.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr char kHost[] = "fusekeeper-webhook.fusekeeper.svc";

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  CHECK_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  CHECK_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  close(fd);
  return ntohs(a.sin_port);
}

double RssMiB(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

struct Servers {
  std::string dir;
  std::unique_ptr<Subprocess> webhook, agent;
  int webhook_port = 0, metrics_port = 0;
  std::string review;
};

Servers& Get() {
  static Servers* s = [] {
    auto* s = new Servers();
    char t[] = "/tmp/fk-whbench-XXXXXX";
    s->dir = mkdtemp(t);
    auto ca = webhook::MakeCa("bench-ca", absl::Hours(24));
    CHECK(ca.ok());
    auto serving = webhook::IssueServing(*ca, {kHost}, absl::Hours(24));
    CHECK(serving.ok());
    std::ofstream(s->dir + "/ca.crt") << ca->cert_pem;
    std::ofstream(s->dir + "/tls.crt") << serving->cert_pem;
    std::ofstream(s->dir + "/tls.key") << serving->key_pem;
    s->webhook = std::make_unique<Subprocess>(std::vector<std::string>{
        RunfilePath("agent/webhook/fusekeeper-webhook"), "--listen=127.0.0.1:0", "--port_file=" + s->dir + "/port",
        "--tls_cert_file=" + s->dir + "/tls.crt", "--tls_key_file=" + s->dir + "/tls.key", "--kube_api=",
        "--native_sidecars=true"});
    CHECK(s->webhook->WaitForStderr("listening on", 1, std::chrono::seconds(30))) << s->webhook->Stderr();
    std::ifstream(s->dir + "/port") >> s->webhook_port;
    fs::create_directories(s->dir + "/kubelet/pods");
    s->metrics_port = FreePort();
    s->agent = std::make_unique<Subprocess>(std::vector<std::string>{
        RunfilePath("agent/fusekeeper"), "--endpoint=unix://" + s->dir + "/csi.sock", "--node_id=n",
        "--kubelet_dir=" + s->dir + "/kubelet", "--state_dir=" + s->dir + "/state",
        "--metrics_address=127.0.0.1:" + std::to_string(s->metrics_port), "--kubelet_url="});
    CHECK(s->agent->WaitForStderr("CSI server listening", 1, std::chrono::seconds(60))) << s->agent->Stderr();
    s->review = json{{"apiVersion", "admission.k8s.io/v1"},
                     {"kind", "AdmissionReview"},
                     {"request",
                      {{"uid", "bench"},
                       {"operation", "CREATE"},
                       {"namespace", "team"},
                       {"resource", {{"group", ""}, {"version", "v1"}, {"resource", "pods"}}},
                       {"object", RecordedPod("inline_fuse_opt_in.json")}}}}
                    .dump();
    return s;
  }();
  return *s;
}

std::unique_ptr<httplib::Client> WebhookClient() {
  Servers& s = Get();
  auto c = std::make_unique<httplib::Client>(absl::StrCat("https://", kHost, ":", s.webhook_port));
  c->set_hostname_addr_map({{kHost, "127.0.0.1"}});
  c->set_ca_cert_path((s.dir + "/ca.crt").c_str());
  c->enable_server_certificate_verification(true);
  c->set_keep_alive(true);
  c->set_tcp_nodelay(true);  // as the API server's Go client does
  return c;
}

void Percentiles(benchmark::State& state, std::vector<double>& us) {
  if (us.empty()) return;
  std::sort(us.begin(), us.end());
  state.counters["p50_us"] = us[us.size() / 2];
  state.counters["p99_us"] = us[std::min(us.size() - 1, us.size() * 99 / 100)];
}

// arg 0: one kept-alive connection; arg 1: a new connection (TLS handshake) per review.
void BM_WebhookReview(benchmark::State& state) {
  Servers& s = Get();
  const bool fresh = state.range(0) == 1;
  auto client = WebhookClient();
  static std::mutex mu;
  static std::vector<double> all;
  if (state.thread_index() == 0) {
    std::lock_guard<std::mutex> lock(mu);
    all.clear();
  }
  std::vector<double> us;
  for (auto _ : state) {
    if (fresh) client = WebhookClient();
    const auto start = std::chrono::steady_clock::now();
    auto r = client->Post("/mutate", s.review, "application/json");
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    if (!r || r->status != 200 || r->body.find("\"patch\"") == std::string::npos) {
      state.SkipWithError("review failed");
      break;
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  all.insert(all.end(), us.begin(), us.end());
  if (state.thread_index() == 0) Percentiles(state, all);
}
BENCHMARK(BM_WebhookReview)->Arg(0)->Arg(1)->Iterations(1000)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_WebhookReview)->Arg(0)->Threads(8)->Iterations(125)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_AgentMetrics(benchmark::State& state) {
  Servers& s = Get();
  httplib::Client c(absl::StrCat("http://127.0.0.1:", s.metrics_port));
  c.set_keep_alive(true);
  c.set_tcp_nodelay(true);
  std::vector<double> us;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    auto r = c.Get("/metrics");
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    if (!r || r->status != 200) {
      state.SkipWithError("GET /metrics failed");
      break;
    }
  }
  Percentiles(state, us);
}
BENCHMARK(BM_AgentMetrics)->Iterations(1000)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_Rss(benchmark::State& state) {
  Servers& s = Get();
  for (auto _ : state) {
  }
  state.counters["webhook_rss_mib"] = RssMiB(s.webhook->pid());
  state.counters["agent_rss_mib"] = RssMiB(s.agent->pid());
}
BENCHMARK(BM_Rss)->Iterations(1);

}  // namespace
}  // namespace fusekeeper

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  auto& s = fusekeeper::Get();
  s.webhook->Signal(SIGTERM);
  s.agent->Signal(SIGTERM);
  s.webhook->Wait(std::chrono::seconds(20));
  s.agent->Wait(std::chrono::seconds(20));
  std::filesystem::remove_all(s.dir);
  return 0;
}
