// BlockingApiClient against the API-server double over real HTTPS: answers of every status, the
// token re-read per call, and the refusals (plain http, a CA that is not the server's, an answer
// over the bound), each naming the request.
#include "agent/kube/blocking_api_client.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_kube.h"

namespace fusekeeper {
namespace {

class BlockingApiClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::string(std::getenv("TEST_TMPDIR")) + "/" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::create_directories(dir_);
    kube_ = std::make_unique<FakeKube>(dir_);
    ASSERT_TRUE(kube_->ok()) << kube_->Diagnostics();
    SetToken("token-1");
  }
  void SetToken(const std::string& token) { std::ofstream(dir_ + "/token") << token << "\n"; }
  BlockingApiOptions Options() const {
    BlockingApiOptions o;
    o.base_url = kube_->url();
    o.ca_file = kube_->ca_file();
    o.token_file = dir_ + "/token";
    return o;
  }
  // The Authorization header of the double's last logged request.
  std::string LastAuth() const {
    const auto log = kube_->Log();
    if (log.empty()) return "<no request>";
    const std::string& line = log.back();
    const size_t at = line.find("\"auth\": \"");
    if (at == std::string::npos) return "<no auth field>";
    return line.substr(at + 9, line.find('"', at + 9) - at - 9);
  }

  std::string dir_;
  std::unique_ptr<FakeKube> kube_;
};

TEST_F(BlockingApiClientTest, GetsAndPatchesWithTheTokenOfTheMoment) {
  kube_->SetObjects({{"/version", R"({"major":"1","minor":"30"})"}});
  BlockingApiClient client(Options());
  auto got = client.Get("/version");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->status, 200);
  EXPECT_TRUE(absl::StrContains(got->body, "\"minor\": \"30\"")) << got->body;
  EXPECT_EQ(LastAuth(), "Bearer token-1");

  SetToken("token-2");  // a projected token rotated
  auto patched = client.Patch("/version", R"({"minor":"31"})", "application/merge-patch+json");
  ASSERT_TRUE(patched.ok()) << patched.status();
  EXPECT_EQ(patched->status, 200);
  EXPECT_EQ(LastAuth(), "Bearer token-2");
}

TEST_F(BlockingApiClientTest, AnHttpErrorIsAnAnswerWithItsBody) {
  kube_->SetMode("403");
  BlockingApiClient client(Options());
  auto got = client.Get("/api/v1/namespaces/x/pods");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->status, 403);
  EXPECT_TRUE(absl::StrContains(got->body, "\"code\":403")) << got->body;
}

TEST_F(BlockingApiClientTest, PlainHttpIsRefusedBeforeAnyRequest) {
  BlockingApiOptions o = Options();
  o.base_url = "http://127.0.0.1:" + std::to_string(kube_->port());
  BlockingApiClient client(o);
  auto got = client.Get("/version");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), "must be https://")) << got.status();
  auto patched = client.Patch("/version", "{}", "application/merge-patch+json");
  EXPECT_EQ(patched.status().code(), absl::StatusCode::kInvalidArgument) << patched.status();
  EXPECT_EQ(kube_->requests(), 0);
}

TEST_F(BlockingApiClientTest, AServerTheCaDoesNotVouchForIsUnavailable) {
  // A second certificate, of nobody: the double's own is not signed by it.
  std::filesystem::create_directories(dir_ + "/other");
  FakeKube other(dir_ + "/other");
  ASSERT_TRUE(other.ok()) << other.Diagnostics();
  BlockingApiOptions o = Options();
  o.ca_file = other.ca_file();
  BlockingApiClient client(o);
  auto got = client.Get("/version");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_TRUE(absl::StrContains(got.status().message(), "GET " + kube_->url() + "/version")) << got.status();
}

TEST_F(BlockingApiClientTest, AnAnswerOverTheBoundIsRefused) {
  kube_->SetObjects({{"/big", "\"" + std::string(64 << 10, 'x') + "\""}});
  BlockingApiOptions o = Options();
  o.max_answer_bytes = 16 << 10;
  auto got = BlockingApiClient(o).Get("/big");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  o.max_answer_bytes = 128 << 10;
  got = BlockingApiClient(o).Get("/big");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->body.size(), (64u << 10) + 2);
}

}  // namespace
}  // namespace fusekeeper
