// fusekeeper-webhook, the built binary, over real HTTPS: AdmissionReviews of recorded pods, its
// own CA put in the MutatingWebhookConfiguration's caBundle (and trusted by a client that knows
// only that bundle), claims looked up in an API server double, bad requests, and cert-manager
// style certificate files renewed while it runs.
#include <httplib.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/fake_kube.h"
#include "tests/testing/subprocess.h"
#include "tests/webhook/recorded_pods.h"

namespace fusekeeper {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr char kServiceName[] = "fusekeeper-webhook.fusekeeper.svc";

json ReviewOf(const json& pod, const std::string& operation = "CREATE") {
  return json{{"apiVersion", "admission.k8s.io/v1"},
              {"kind", "AdmissionReview"},
              {"request",
               {{"uid", "uid-1"},
                {"operation", operation},
                {"namespace", "team"},
                {"resource", {{"group", ""}, {"version", "v1"}, {"resource", "pods"}}},
                {"object", pod}}}};
}

json Recorded(const std::string& name) { return RecordedPod(name); }

class WebhookTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char t[] = "/tmp/fk-webhook-XXXXXX";
    dir_ = mkdtemp(t);
    fs::create_directories(dir_ + "/kube");
    kube_ = std::make_unique<FakeKube>(dir_ + "/kube");
  }
  void TearDown() override {
    if (webhook_) {
      webhook_->Signal(SIGTERM);
      EXPECT_EQ(webhook_->Wait(std::chrono::seconds(20)).value_or(-1), 0) << webhook_->Stderr();
    }
    fs::remove_all(dir_);
  }
  // Starts the webhook with `flags` (plus a loopback port) and waits until it listens.
  void Start(std::vector<std::string> flags) {
    std::vector<std::string> argv = {RunfilePath("agent/webhook/fusekeeper-webhook"), "--listen=127.0.0.1:0",
                                     "--port_file=" + dir_ + "/port"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    webhook_ = std::make_unique<Subprocess>(argv);
    ASSERT_TRUE(webhook_->WaitForStderr("listening on", 1, std::chrono::seconds(20))) << webhook_->Stderr();
    std::ifstream(dir_ + "/port") >> port_;
    ASSERT_GT(port_, 0);
  }
  // A client that reaches the webhook by its Service name and trusts only `ca_pem`.
  std::unique_ptr<httplib::Client> Client(const std::string& ca_file) {
    auto c = std::make_unique<httplib::Client>(absl::StrCat("https://", kServiceName, ":", port_));
    c->set_hostname_addr_map({{kServiceName, "127.0.0.1"}});
    c->set_ca_cert_path(ca_file.c_str());
    c->enable_server_certificate_verification(true);
    c->set_connection_timeout(std::chrono::seconds(10));
    c->set_read_timeout(std::chrono::seconds(10));
    return c;
  }
  // POSTs `review`; returns the HTTP status and the parsed response (null unless 200).
  std::pair<int, json> Post(httplib::Client& c, const std::string& body) {
    auto r = c.Post("/mutate", body, "application/json");
    if (!r) {
      ADD_FAILURE() << "no answer: " << httplib::to_string(r.error()) << "\n" << webhook_->Stderr();
      return {0, json()};
    }
    return {r->status, r->status == 200 ? json::parse(r->body)["response"] : json()};
  }
  // The pod after the response's patch.
  static json Apply(const json& pod, const json& response) {
    if (!response.contains("patch")) return pod;
    std::string text;
    EXPECT_TRUE(absl::Base64Unescape(response["patch"].get<std::string>(), &text));
    EXPECT_EQ(response["patchType"], "JSONPatch");
    return pod.patch(json::parse(text));
  }
  void ServeApiObjects() {
    kube_->SetObjects({
        {"/version", R"({"major":"1","minor":"30","gitVersion":"v1.30.2"})"},
        {"/api/v1/persistentvolumes/pv-ours", R"({"kind":"PersistentVolume","spec":{"csi":{"driver":"fusekeeper.csi","volumeHandle":"ds"}}})"},
        {"/api/v1/persistentvolumes/pv-ebs", R"({"kind":"PersistentVolume","spec":{"csi":{"driver":"ebs.csi.aws.com","volumeHandle":"vol-1"}}})"},
        {"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/fusekeeper-webhook",
         R"({"kind":"MutatingWebhookConfiguration","webhooks":[{"name":"pods.fusekeeper.csi","clientConfig":{"service":{"name":"fusekeeper-webhook","namespace":"fusekeeper","path":"/mutate"}}}]})"},
    });
    kube_->SetPvcs({{"team/shared-dataset", "pv-ours"}, {"team/ebs-claim", "pv-ebs"}});
    fs::create_directories(dir_ + "/sa");
    fs::copy_file(kube_->ca_file(), dir_ + "/sa/ca.crt");
    std::ofstream(dir_ + "/sa/token") << "webhook-token";
  }

  std::string dir_;
  std::unique_ptr<FakeKube> kube_;
  std::unique_ptr<Subprocess> webhook_;
  int port_ = 0;
};

TEST_F(WebhookTest, OwnCertificateInTheCaBundleMutatesPodsAndLooksUpClaims) {
  ASSERT_TRUE(kube_->ok()) << kube_->Diagnostics();
  ServeApiObjects();
  Start({"--kube_api=" + kube_->url(), "--kube_secrets_dir=" + dir_ + "/sa", "--native_sidecars=auto"});
  // The CA it made goes into the configuration's caBundle; a client that trusts only that bundle
  // reaches it by its Service name.
  ASSERT_TRUE(kube_->WaitForRequest("PATCH /apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/fusekeeper-webhook"))
      << webhook_->Stderr();
  std::string bundle;
  for (const std::string& line : kube_->Log()) {
    const json req = json::parse(line);
    if (req["verb"] != "PATCH") continue;
    EXPECT_EQ(req["auth"], "Bearer webhook-token");
    const json patch = json::parse(req["body"].get<std::string>());
    ASSERT_EQ(patch.size(), 1u);
    EXPECT_EQ(patch[0]["path"], "/webhooks/0/clientConfig/caBundle");
    ASSERT_TRUE(absl::Base64Unescape(patch[0]["value"].get<std::string>(), &bundle));
  }
  ASSERT_TRUE(absl::StrContains(bundle, "BEGIN CERTIFICATE"));
  std::ofstream(dir_ + "/bundle.pem") << bundle;
  auto client = Client(dir_ + "/bundle.pem");

  // An inline FUSE volume with opt-in: the server injected (native sidecars: /version says 1.30).
  const json fuse_pod = Recorded("inline_fuse_opt_in.json");
  auto [status, response] = Post(*client, ReviewOf(fuse_pod).dump());
  ASSERT_EQ(status, 200);
  EXPECT_EQ(response["uid"], "uid-1");
  EXPECT_EQ(response["allowed"], true);
  const json injected = Apply(fuse_pod, response);
  EXPECT_EQ(injected["spec"]["initContainers"][0]["name"], "fusekeeper-server-data");
  EXPECT_EQ(injected["spec"]["initContainers"][0]["restartPolicy"], "Always");
  EXPECT_EQ(injected["spec"]["containers"][0]["volumeMounts"][0]["mountPropagation"], "HostToContainer");
  // Admitted again: nothing more.
  auto [status2, again] = Post(*client, ReviewOf(injected).dump());
  ASSERT_EQ(status2, 200);
  EXPECT_FALSE(again.contains("patch")) << again.dump();

  // Claims: ours (looked up: claim → PV → driver) gets HostToContainer, another driver's not.
  const json claim_pod = Recorded("claims.json");
  auto [status3, claimed] = Post(*client, ReviewOf(claim_pod).dump());
  ASSERT_EQ(status3, 200);
  const json out = Apply(claim_pod, claimed);
  EXPECT_EQ(out["spec"]["containers"][0]["volumeMounts"][0]["mountPropagation"], "HostToContainer");
  EXPECT_FALSE(out["spec"]["containers"][0]["volumeMounts"][1].contains("mountPropagation"));
  EXPECT_EQ(out["spec"]["containers"][1]["volumeMounts"][0]["mountPropagation"], "HostToContainer");

  // A pod without our volumes: allowed, untouched.
  auto [status4, plain] = Post(*client, ReviewOf(Recorded("unrelated.json")).dump());
  ASSERT_EQ(status4, 200);
  EXPECT_EQ(plain["allowed"], true);
  EXPECT_FALSE(plain.contains("patch"));
  // Not a CREATE: allowed, untouched.
  auto [status5, update] = Post(*client, ReviewOf(fuse_pod, "UPDATE").dump());
  ASSERT_EQ(status5, 200);
  EXPECT_FALSE(update.contains("patch"));
}

TEST_F(WebhookTest, BadRequestsGetClearAnswersNeverACrash) {
  ASSERT_TRUE(kube_->ok());
  // cert-manager style: certificate files for the Service name, made here.
  Subprocess gen({"/usr/bin/openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                  "-keyout", dir_ + "/tls.key", "-out", dir_ + "/tls.crt", "-days", "1", "-subj", "/CN=webhook",
                  "-addext", std::string("subjectAltName=DNS:") + kServiceName});
  ASSERT_EQ(gen.Wait(std::chrono::seconds(30)).value_or(-1), 0);
  Start({"--tls_cert_file=" + dir_ + "/tls.crt", "--tls_key_file=" + dir_ + "/tls.key", "--kube_api=",
         "--native_sidecars=false", "--max_request_bytes=65536"});
  auto client = Client(dir_ + "/tls.crt");
  EXPECT_EQ(Post(*client, "{not json").first, 400);
  EXPECT_EQ(Post(*client, R"({"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"x"}})").first,
            400);
  EXPECT_EQ(Post(*client, R"({"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"})").first, 400);
  EXPECT_EQ(Post(*client, R"([1,2,3])").first, 400);
  auto big = client->Post("/mutate", std::string(200000, ' '), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  // Injection on a cluster without native sidecars: a denial that says why.
  auto [status, response] = Post(*client, ReviewOf(Recorded("inline_fuse_opt_in.json")).dump());
  ASSERT_EQ(status, 200);
  EXPECT_EQ(response["allowed"], false);
  EXPECT_TRUE(absl::StrContains(response["status"]["message"].get<std::string>(), "1.29")) << response.dump();
  // No API server: claims cannot be looked up; the pod is allowed and told.
  auto [status2, claims] = Post(*client, ReviewOf(Recorded("claims.json")).dump());
  ASSERT_EQ(status2, 200);
  EXPECT_EQ(claims["allowed"], true);
  ASSERT_TRUE(claims.contains("warnings"));
  EXPECT_TRUE(absl::StrContains(claims["warnings"][0].get<std::string>(), "no API server"));
  // Still healthy after all that.
  auto health = client->Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST_F(WebhookTest, RenewedCertificateFilesAreServedWithoutARestart) {
  auto make = [&](const std::string& name) {
    Subprocess gen({"/usr/bin/openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", dir_ + "/" + name + ".key", "-out", dir_ + "/" + name + ".crt", "-days", "1",
                    "-subj", "/CN=" + name, "-addext", std::string("subjectAltName=DNS:") + kServiceName});
    ASSERT_EQ(gen.Wait(std::chrono::seconds(30)).value_or(-1), 0);
  };
  make("first");
  make("second");
  fs::copy_file(dir_ + "/first.crt", dir_ + "/tls.crt");
  fs::copy_file(dir_ + "/first.key", dir_ + "/tls.key");
  Start({"--tls_cert_file=" + dir_ + "/tls.crt", "--tls_key_file=" + dir_ + "/tls.key", "--kube_api=",
         "--native_sidecars=true", "--cert_reload_period_ms=50"});
  EXPECT_TRUE(Client(dir_ + "/first.crt")->Get("/healthz"));
  // The Secret is renewed (files replaced): the next handshakes use the new certificate.
  fs::copy_file(dir_ + "/second.key", dir_ + "/tls.key.new");
  fs::copy_file(dir_ + "/second.crt", dir_ + "/tls.crt.new");
  fs::rename(dir_ + "/tls.key.new", dir_ + "/tls.key");
  fs::rename(dir_ + "/tls.crt.new", dir_ + "/tls.crt");
  ASSERT_TRUE(webhook_->WaitForStderr("serving the renewed certificate", 1, std::chrono::seconds(20)))
      << webhook_->Stderr();
  EXPECT_TRUE(Client(dir_ + "/second.crt")->Get("/healthz")) << "the renewed certificate is served";
  EXPECT_FALSE(Client(dir_ + "/first.crt")->Get("/healthz")) << "the old one is not";
}

}  // namespace
}  // namespace fusekeeper
