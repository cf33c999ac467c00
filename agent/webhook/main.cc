// fusekeeper-webhook: the mutating admission webhook for pods (see pod_mutation.h for what it
// does to them). HTTPS (cpp-httplib) on --listen: POST /mutate takes an AdmissionReview
// (admission.k8s.io/v1), GET /healthz answers ok.
//
// Certificates, one of:
//  - --tls_cert_file/--tls_key_file (e.g. a cert-manager Secret): read at start and again
//    whenever the files change, so a renewed certificate is served without a restart;
//  - neither: the webhook makes its own CA and serving certificate for
//    <service>.<namespace>.svc at start, renews the serving certificate when a third of its
//    validity is left, and puts the CA in the caBundle of --webhook_config_name's webhooks
//    (RBAC: mutatingwebhookconfigurations get/patch on that one name). The CA lives in memory:
//    run one replica in this mode (a restart makes a new CA and patches the caBundle again).
#include <httplib.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <pthread.h>
#include <signal.h>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agent/version.h"
#include "agent/webhook/admission.h"
#include "agent/webhook/certs.h"
#include "agent/webhook/kube_client.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"

namespace {

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

std::string DefaultKubeApi() {
  const std::string host = EnvOr("KUBERNETES_SERVICE_HOST", "");
  if (host.empty()) return "";
  const std::string bracketed = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  return "https://" + bracketed + ":" + EnvOr("KUBERNETES_SERVICE_PORT", "443");
}

constexpr char kDefaultServerArgs[] =
    R"json(["--socket=$(FUSEKEEPER_SOCKET)","--ready_file=$(FUSEKEEPER_READY_FILE)","serve","--root=/"])json";

}  // namespace

DEFINE_string(listen, ":8443", "host:port (or :port) to serve HTTPS on");
DEFINE_string(tls_cert_file, "", "serving certificate (PEM); with --tls_key_file. Empty: the webhook makes its own");
DEFINE_string(tls_key_file, "", "serving key (PEM)");
DEFINE_string(service_name, "fusekeeper-webhook", "the webhook's Service (names in its own certificate)");
DEFINE_string(namespace, EnvOr("POD_NAMESPACE", "fusekeeper"), "the webhook's namespace");
DEFINE_string(webhook_config_name, "fusekeeper-webhook",
              "the MutatingWebhookConfiguration whose caBundle the webhook keeps in step with its own CA "
              "(own certificates only); empty: leave it to someone else");
DEFINE_int32(cert_validity_hours, 24 * 30, "validity of the serving certificate it makes (renewed at 2/3)");
DEFINE_string(driver_name, "fusekeeper.csi", "the CSI driver whose volumes this webhook looks after");
DEFINE_string(default_server_image, "fusekeeper/fkserve:" FUSEKEEPER_VERSION_STRING,
              "FUSE server image injected when a pod names none (fusekeeper.csi/server-image)");
DEFINE_string(default_server_args, kDefaultServerArgs,
              "JSON array of the injected server's arguments when a pod names none (fusekeeper.csi/server-args)");
DEFINE_uint32(default_server_uid, 65534, "uid (and gid) of an injected server whose volume names no serverUid");
DEFINE_string(default_server_cpu_request, "10m", "injected server's CPU request");
DEFINE_string(default_server_memory_request, "32Mi", "injected server's memory request");
DEFINE_string(default_server_memory_limit, "256Mi", "injected server's memory limit");
DEFINE_string(native_sidecars, "auto",
              "whether the cluster runs native sidecars (Kubernetes 1.29+): true, false, or auto (ask the API "
              "server's /version at start; unknown counts as false, so injection is refused rather than broken)");
DEFINE_string(kube_api, DefaultKubeApi(), "API server base URL (default: in-cluster); empty: no API calls");
DEFINE_string(kube_secrets_dir, "/var/run/secrets/kubernetes.io/serviceaccount", "service account token and ca.crt");
DEFINE_int32(max_request_bytes, 3 << 20, "AdmissionReview bodies larger than this are refused (413)");
DEFINE_int32(cert_reload_period_ms, 10000, "how often --tls_cert_file/--tls_key_file are checked for a renewal");
DEFINE_string(port_file, "", "write the port listened on here once listening (for --listen=host:0)");

namespace fusekeeper::webhook {
namespace {

// The certificate and key served, swapped under a lock; each TLS handshake takes the current pair.
class CertStore {
 public:
  struct Pair {
    X509* cert = nullptr;
    EVP_PKEY* key = nullptr;
    ~Pair() {
      X509_free(cert);
      EVP_PKEY_free(key);
    }
  };
  absl::Status Set(const std::string& cert_pem, const std::string& key_pem) {
    auto p = std::make_shared<Pair>();
    BIO* cb = BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size()));
    BIO* kb = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
    p->cert = cb ? PEM_read_bio_X509(cb, nullptr, nullptr, nullptr) : nullptr;
    p->key = kb ? PEM_read_bio_PrivateKey(kb, nullptr, nullptr, nullptr) : nullptr;
    BIO_free(cb);
    BIO_free(kb);
    if (p->cert == nullptr || p->key == nullptr || X509_check_private_key(p->cert, p->key) != 1) {
      return absl::InvalidArgumentError("the certificate and key are unreadable or do not belong together");
    }
    std::lock_guard<std::mutex> lock(mu_);
    current_ = std::move(p);
    return absl::OkStatus();
  }
  std::shared_ptr<Pair> Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return current_;
  }

 private:
  std::mutex mu_;
  std::shared_ptr<Pair> current_;
};

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  FILE* f = fopen(path.c_str(), "re");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot read ", path, ": ", strerror(errno)));
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
  fclose(f);
  return out;
}

// What tells one version of a file from the next: a Secret update replaces it (new inode), an
// edit changes its mtime or size.
std::tuple<ino_t, int64_t, int64_t, off_t> FileVersion(const std::string& path) {
  struct stat st{};
  if (stat(path.c_str(), &st) != 0) return {};
  return {st.st_ino, st.st_mtim.tv_sec, st.st_mtim.tv_nsec, st.st_size};
}

absl::Status LoadFiles(CertStore& store) {
  auto cert = ReadFile(FLAGS_tls_cert_file);
  if (!cert.ok()) return cert.status();
  auto key = ReadFile(FLAGS_tls_key_file);
  if (!key.ok()) return key.status();
  return store.Set(*cert, *key);
}

// Puts `ca_pem` in the caBundle of every webhook of the configuration. Retried by the caller.
absl::Status PatchCaBundle(const BlockingApiClient& kube, const std::string& config, const std::string& ca_pem) {
  const std::string path = absl::StrCat("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/", config);
  auto got = kube.Get(path);
  if (!got.ok()) return got.status();
  if (got->status != 200) return absl::UnavailableError(absl::StrCat("GET ", path, ": HTTP ", got->status));
  const nlohmann::json doc = nlohmann::json::parse(got->body, nullptr, false);
  if (!doc.is_object() || !doc.contains("webhooks") || !doc["webhooks"].is_array()) {
    return absl::DataLossError(absl::StrCat("GET ", path, ": no webhooks"));
  }
  nlohmann::json patch = nlohmann::json::array();
  const std::string bundle = absl::Base64Escape(ca_pem);
  for (size_t i = 0; i < doc["webhooks"].size(); ++i) {
    patch.push_back({{"op", "add"}, {"path", absl::StrCat("/webhooks/", i, "/clientConfig/caBundle")}, {"value", bundle}});
  }
  auto patched = kube.Patch(path, patch.dump(), "application/json-patch+json");
  if (!patched.ok()) return patched.status();
  if (patched->status != 200) return absl::UnavailableError(absl::StrCat("PATCH ", path, ": HTTP ", patched->status));
  return absl::OkStatus();
}

std::atomic<bool> g_stop{false};

// The flags that make the policy: INVALID_ARGUMENT naming the flag.
absl::Status PolicyFromFlags(Policy* policy) {
  policy->driver = FLAGS_driver_name;
  policy->server.image = FLAGS_default_server_image;
  policy->server.uid = FLAGS_default_server_uid;
  policy->server.cpu_request = FLAGS_default_server_cpu_request;
  policy->server.memory_request = FLAGS_default_server_memory_request;
  policy->server.memory_limit = FLAGS_default_server_memory_limit;
  const nlohmann::json args = nlohmann::json::parse(FLAGS_default_server_args, nullptr, false);
  bool ok = args.is_array();
  for (const auto& a : args) ok = ok && a.is_string();
  if (!ok) return absl::InvalidArgumentError("--default_server_args must be a JSON array of strings");
  policy->server.args = args.get<std::vector<std::string>>();
  if (FLAGS_tls_cert_file.empty() != FLAGS_tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert_file and --tls_key_file go together (or neither: the webhook makes its own)");
  }
  if (FLAGS_native_sidecars != "auto" && FLAGS_native_sidecars != "true" && FLAGS_native_sidecars != "false") {
    return absl::InvalidArgumentError("--native_sidecars must be auto, true or false");
  }
  return absl::OkStatus();
}

// --native_sidecars=auto asks the API server's version.
bool NativeSidecars(const BlockingApiClient* kube) {
  if (FLAGS_native_sidecars != "auto") return FLAGS_native_sidecars == "true";
  absl::StatusOr<bool> native = kube ? HasNativeSidecars(*kube) : absl::UnavailableError("no API server (--kube_api)");
  LOG_IF(WARNING, !native.ok()) << "cannot tell whether the cluster runs native sidecars (" << native.status()
                                << "); server injection is refused until the webhook restarts or "
                                   "--native_sidecars is set";
  LOG_IF(INFO, native.ok()) << "native sidecars: " << (*native ? "yes" : "no (Kubernetes < 1.29): server injection is refused");
  return native.ok() && *native;
}

// Keeps the serving certificate fresh on a thread of its own: renewed files (a cert-manager Secret
// update) served from the next handshake on; or, with its own CA, a certificate renewed at two
// thirds of its validity and the webhook configuration's caBundle kept in step.
class CertRenewer {
 public:
  // INVALID_ARGUMENT / INTERNAL if no certificate can be served at all.
  absl::Status Start(CertStore& certs, const BlockingApiClient* kube) {
    if (!FLAGS_tls_cert_file.empty()) {
      if (auto s = LoadFiles(certs); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("--tls_cert_file/--tls_key_file: ", s.message()));
      }
      thread_ = std::thread([this, &certs] { WatchFiles(certs); });
      return absl::OkStatus();
    }
    const std::string svc = absl::StrCat(FLAGS_service_name, ".", FLAGS_namespace, ".svc");
    const std::vector<std::string> names = {svc, svc + ".cluster.local", absl::StrCat(FLAGS_service_name, ".", FLAGS_namespace)};
    auto ca = MakeCa(absl::StrCat("fusekeeper-webhook-ca.", FLAGS_namespace), absl::Hours(24 * 365 * 5));
    const absl::Duration validity = absl::Hours(FLAGS_cert_validity_hours);
    auto serving = ca.ok() ? IssueServing(*ca, names, validity) : ca.status();
    if (!serving.ok() || !certs.Set(serving->cert_pem, serving->key_pem).ok()) {
      return absl::InternalError(absl::StrCat("making the webhook's own certificate: ", serving.status().message()));
    }
    LOG(INFO) << "serving its own certificate for " << svc;
    thread_ = std::thread([this, &certs, kube, ca = *ca, names, validity] { KeepOwn(certs, kube, ca, names, validity); });
    return absl::OkStatus();
  }
  // Ends the thread (under its mutex: a wake-up between its check and its wait is not lost).
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      g_stop = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  ~CertRenewer() { Stop(); }

 private:
  void WatchFiles(CertStore& certs) {
    auto seen = std::make_pair(FileVersion(FLAGS_tls_cert_file), FileVersion(FLAGS_tls_key_file));
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(FLAGS_cert_reload_period_ms), [] { return g_stop.load(); })) {
      const auto now = std::make_pair(FileVersion(FLAGS_tls_cert_file), FileVersion(FLAGS_tls_key_file));
      if (now == seen) continue;
      seen = now;
      absl::Status s = LoadFiles(certs);
      LOG_IF(INFO, s.ok()) << "serving the renewed certificate from " << FLAGS_tls_cert_file;
      LOG_IF(WARNING, !s.ok()) << "renewed certificate files not usable yet: " << s;
    }
  }
  void KeepOwn(CertStore& certs, const BlockingApiClient* kube, const KeyAndCert& ca, const std::vector<std::string>& names,
               absl::Duration validity) {
    bool bundle_done = FLAGS_webhook_config_name.empty() || kube == nullptr;
    LOG_IF(WARNING, !FLAGS_webhook_config_name.empty() && kube == nullptr)
        << "no API server: the caBundle of " << FLAGS_webhook_config_name << " is not kept in step";
    absl::Duration retry = absl::Seconds(1);
    absl::Time renew_at = absl::Now() + validity * 2 / 3;
    std::unique_lock<std::mutex> lock(mu_);
    while (!g_stop) {
      if (!bundle_done) {
        absl::Status s = PatchCaBundle(*kube, FLAGS_webhook_config_name, ca.cert_pem);
        bundle_done = s.ok();
        LOG_IF(INFO, s.ok()) << "caBundle of " << FLAGS_webhook_config_name << " set to this webhook's CA";
        LOG_IF(WARNING, !s.ok()) << "setting the caBundle of " << FLAGS_webhook_config_name << ": " << s
                                 << "; retrying in " << retry;
        if (!s.ok()) retry = std::min(retry * 2, absl::Seconds(60));
      }
      if (absl::Now() >= renew_at) {
        auto renewed = IssueServing(ca, names, validity);
        if (renewed.ok() && certs.Set(renewed->cert_pem, renewed->key_pem).ok()) {
          LOG(INFO) << "serving certificate renewed";
          renew_at = absl::Now() + validity * 2 / 3;
        }
      }
      const absl::Duration wait = bundle_done ? std::min(absl::Minutes(10), renew_at - absl::Now()) : retry;
      cv_.wait_for(lock, absl::ToChronoMilliseconds(std::max(wait, absl::Seconds(1))), [] { return g_stop.load(); });
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

// The HTTPS server: TLS from `certs` at each handshake, /mutate and /healthz.
void SetUpServer(httplib::SSLServer& server, const Policy& policy, const ClaimResolver& resolve) {
  server.set_payload_max_length(static_cast<size_t>(FLAGS_max_request_bytes));
  // Answers go out at once: with Nagle on, a response split into header and body writes waits
  // for the client's delayed ACK (40 ms per review, measured).
  server.set_tcp_nodelay(true);
  // The API server keeps its connections: a TLS handshake costs ~3.5 ms, a review ~0.13 ms.
  server.set_keep_alive_max_count(1000);
  server.set_keep_alive_timeout(30);
  server.set_read_timeout(std::chrono::seconds(10));
  server.set_write_timeout(std::chrono::seconds(10));
  server.Post("/mutate", [&policy, &resolve](const httplib::Request& req, httplib::Response& res) {
    const absl::Time start = absl::Now();
    HttpAnswer a = Review(req.body, policy, resolve);
    res.status = a.status;
    res.set_content(a.body, a.content_type.c_str());
    VLOG(1) << "review of " << req.body.size() << " bytes -> " << a.status << " in " << (absl::Now() - start);
    LOG_IF(WARNING, a.status != 200) << "refused a review: " << a.body;
  });
  server.Get("/healthz", [](const httplib::Request&, httplib::Response& res) { res.set_content("ok\n", "text/plain"); });
  server.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.status == 413) res.set_content("fusekeeper webhook: the request is too large\n", "text/plain");
  });
}

// Binds --listen (port 0: any); the port, or -1. With --port_file, the port is written there.
int Bind(httplib::SSLServer& server, const std::string& host, int port) {
  if (port == 0) {
    port = server.bind_to_any_port(host);  // -1 on failure
  } else if (!server.bind_to_port(host.c_str(), port)) {
    port = -1;
  }
  if (port > 0 && !FLAGS_port_file.empty()) {
    const std::string tmp = FLAGS_port_file + ".tmp";
    if (FILE* f = fopen(tmp.c_str(), "we"); f != nullptr) {
      fprintf(f, "%d", port);
      fclose(f);
      rename(tmp.c_str(), FLAGS_port_file.c_str());
    }
  }
  return port;
}

int Main() {
  // SIGTERM/SIGINT are taken by one thread (sigwait), not a handler: stopping the server is not
  // async-signal-safe. Blocked before any thread starts, so every thread inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  Policy policy;
  if (absl::Status s = PolicyFromFlags(&policy); !s.ok()) {
    LOG(ERROR) << s.message();
    return 2;
  }
  const std::vector<std::string> listen = absl::StrSplit(FLAGS_listen, absl::MaxSplits(':', 1));
  int port = 0;
  if (listen.size() != 2 || !absl::SimpleAtoi(listen[1], &port) || port < 0 || port > 65535) {
    LOG(ERROR) << "--listen must be host:port or :port, not " << FLAGS_listen;
    return 2;
  }
  std::unique_ptr<BlockingApiClient> kube;
  if (!FLAGS_kube_api.empty()) {
    kube = std::make_unique<BlockingApiClient>(BlockingApiOptions{.base_url = FLAGS_kube_api,
                                                          .ca_file = FLAGS_kube_secrets_dir + "/ca.crt",
                                                          .token_file = FLAGS_kube_secrets_dir + "/token"});
  }
  policy.native_sidecars = NativeSidecars(kube.get());
  CertStore certs;
  CertRenewer renewer;
  if (absl::Status s = renewer.Start(certs, kube.get()); !s.ok()) {
    LOG(ERROR) << s.message();
    return 2;
  }
  httplib::SSLServer server([&certs](SSL_CTX& ctx) {
    SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
    SSL_CTX_set_cert_cb(
        &ctx,
        [](SSL* ssl, void* arg) -> int {
          auto pair = static_cast<CertStore*>(arg)->Get();
          if (pair == nullptr) return 0;
          return SSL_use_certificate(ssl, pair->cert) == 1 && SSL_use_PrivateKey(ssl, pair->key) == 1 ? 1 : 0;
        },
        &certs);
    return true;
  });
  if (!server.is_valid()) {
    LOG(ERROR) << "cannot set up TLS";
    return 2;
  }
  std::unique_ptr<ClaimLookup> claims;
  if (kube) claims = std::make_unique<ClaimLookup>(*kube, FLAGS_driver_name);
  const ClaimResolver resolve = [&claims](const std::string& ns, const std::vector<std::string>& names) {
    if (claims) return claims->Resolve(ns, names);
    ClaimInfo none;
    none.warnings.push_back("fusekeeper: no API server to look up claims with; their mounts were left as written");
    return none;
  };
  SetUpServer(server, policy, resolve);
  const std::string host = listen[0].empty() ? "0.0.0.0" : listen[0];
  port = Bind(server, host, port);
  if (port <= 0) {
    LOG(ERROR) << "cannot listen on " << FLAGS_listen;
    return 2;
  }
  std::atomic<bool> signalled{false};
  std::thread signals([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    signalled = true;
    LOG(INFO) << strsignal(sig) << ": stopping";
    server.stop();
  });
  LOG(INFO) << "fusekeeper-webhook " << FUSEKEEPER_VERSION_STRING << " listening on " << host << ":" << port
            << " for driver " << policy.driver;
  server.listen_after_bind();
  if (!signalled) kill(getpid(), SIGTERM);  // the server ended on its own: release the signal thread
  signals.join();
  renewer.Stop();
  LOG(INFO) << "stopped";
  return 0;
}

}  // namespace
}  // namespace fusekeeper::webhook

int main(int argc, char** argv) {
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  gflags::SetUsageMessage("fusekeeper-webhook: mutating admission webhook for pods that use fusekeeper volumes");
  gflags::SetVersionString(FUSEKEEPER_VERSION_STRING);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  return fusekeeper::webhook::Main();
}
