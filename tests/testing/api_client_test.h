// A test fixture for clients of the API server: the API-server double (fake_kube.h) over real
// HTTPS in a temporary directory with a service-account token, a loop on its own thread, a
// blocking pool and an HttpClient on that loop. Subclasses make their client in the test and
// destroy it on the loop in DestroyClient(), before everything else goes.
#pragma once

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "agent/kube/event_recorder.h"
#include "agent/kube/http_client.h"
#include "agent/loop/blocking_pool.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_kube.h"
#include "tests/testing/loop_thread.h"

namespace fusekeeper {

// A temporary directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    char t[] = "/tmp/fk-kube-XXXXXX";
    path_ = mkdtemp(t);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class ApiClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    kube_ = std::make_unique<FakeKube>(dir_.path());
    ASSERT_TRUE(kube_->ok()) << kube_->Diagnostics();
    { std::ofstream(dir_.path() + "/token") << "secret-token\n"; }
    pool_ = std::make_unique<BlockingPool>(lt_.loop(), BlockingPoolOptions{.threads = 1});
    lt_.RunOnLoop([&] {
      auto h = HttpClient::Create(lt_.loop());
      ASSERT_TRUE(h.ok());
      http_ = std::move(*h);
    });
  }
  void TearDown() override {
    lt_.RunOnLoop([&] { DestroyClient(); });
    if (pool_) pool_->Shutdown(absl::Seconds(5));  // none if SetUp failed early
    lt_.StopAndJoin();
    http_.reset();
  }
  // On the loop: the client under test goes first.
  virtual void DestroyClient() = 0;
  // How a client reaches the double (or `url` instead), with the token written in SetUp.
  KubeApiConfig Api(const std::string& url = "") const {
    return KubeApiConfig{url.empty() ? kube_->url() : url, dir_.path() + "/token", kube_->ca_file(), false};
  }

  TempDir dir_;
  std::unique_ptr<FakeKube> kube_;
  LoopThread lt_;
  std::unique_ptr<BlockingPool> pool_;
  std::unique_ptr<HttpClient> http_;
};

}  // namespace fusekeeper
