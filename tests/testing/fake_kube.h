// FakeKube: the API server / kubelet test double (fake_kube.py) over real HTTPS on loopback,
// with a self-signed certificate made at test time (openssl). Requests it received are read
// back from its log; waits are on its stderr (inotify), never sleeps.
#pragma once

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/testing/subprocess.h"

namespace fusekeeper {

class FakeKube {
 public:
  // `dir` holds the certificate, the log, the mode and pods files.
  explicit FakeKube(const std::string& dir) : dir_(dir) {
    Subprocess gen({"/usr/bin/openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", dir + "/key.pem", "-out", dir + "/cert.pem", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"});
    ok_ = gen.Wait(std::chrono::seconds(30)).value_or(-1) == 0;
    SetMode("ok");
    std::ofstream(dir + "/pods.json") << R"({"kind":"PodList","items":[]})";
    server_ = std::make_unique<Subprocess>(std::vector<std::string>{
        "/usr/bin/python3", RunfilePath("tests/testing/fake_kube.py"), "--cert=" + dir + "/cert.pem",
        "--key=" + dir + "/key.pem", "--log=" + dir + "/requests.jsonl", "--port-file=" + dir + "/port",
        "--pods-file=" + dir + "/pods.json", "--mode-file=" + dir + "/mode", "--pvcs-file=" + dir + "/pvcs.json",
        "--objects-file=" + dir + "/objects.json", "--pod-store-file=" + dir + "/pod-store.json"});
    ok_ = ok_ && server_->WaitForStderr("listening", 1, std::chrono::seconds(20));
    std::ifstream(dir + "/port") >> port_;
  }
  bool ok() const { return ok_; }
  std::string Diagnostics() const { return server_ ? server_->Stderr() : ""; }
  int port() const { return port_; }
  std::string url() const { return "https://127.0.0.1:" + std::to_string(port_); }
  std::string ca_file() const { return dir_ + "/cert.pem"; }
  void SetMode(const std::string& mode) { std::ofstream(dir_ + "/mode") << mode; }
  void SetPods(const std::string& json) {
    { std::ofstream(dir_ + "/pods.json.tmp") << json; }
    std::rename((dir_ + "/pods.json.tmp").c_str(), (dir_ + "/pods.json").c_str());
  }
  // PersistentVolumeClaims the API server double answers: "<ns>/<claim>" → bound PV name.
  void SetPvcs(const std::map<std::string, std::string>& bound) {
    std::string json = "{";
    for (const auto& [k, v] : bound) json += (json.size() > 1 ? "," : "") + ("\"" + k + "\":\"" + v + "\"");
    { std::ofstream(dir_ + "/pvcs.json.tmp") << json << "}"; }
    std::rename((dir_ + "/pvcs.json.tmp").c_str(), (dir_ + "/pvcs.json").c_str());
  }
  // Objects answered to GET (and PATCH) of their path, e.g. "/version" → R"({"major":"1"})".
  void SetObjects(const std::map<std::string, std::string>& by_path) {
    std::string json = "{";
    for (const auto& [k, v] : by_path) json += (json.size() > 1 ? "," : "") + ("\"" + k + "\":" + v);
    { std::ofstream(dir_ + "/objects.json.tmp") << json << "}"; }
    std::rename((dir_ + "/objects.json.tmp").c_str(), (dir_ + "/objects.json").c_str());
  }
  // The pods the API server double holds (POSTed by the agent), as its JSON object by
  // "<ns>/<name>"; "{}" before the first.
  std::string PodStore() const {
    std::ifstream in(dir_ + "/pod-store.json");
    std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return s.empty() ? "{}" : s;
  }
  // A request to the double from the test itself (as kubectl would make it): "DELETE", path,
  // body. Returns the HTTP status, or -1.
  int Call(const std::string& verb, const std::string& path, const std::string& body = "") const {
    std::vector<std::string> argv = {"/usr/bin/curl", "-sS", "-o", "/dev/null", "-w", "%{stderr}HTTP=%{http_code}\n", "--cacert",
                                     ca_file(), "-X", verb, url() + path};
    if (!body.empty()) {
      argv.insert(argv.end(), {"-H", "Content-Type: application/merge-patch+json", "--data-binary", body});
    }
    Subprocess curl(argv);
    if (curl.Wait(std::chrono::seconds(20)).value_or(-1) != 0) return -1;
    const std::string err = curl.Stderr();
    const size_t at = err.rfind("HTTP=");
    return at == std::string::npos ? -1 : std::atoi(err.c_str() + at + 5);
  }
  // Waits until a request starting with "<VERB> <path prefix>" has arrived.
  bool WaitForRequest(const std::string& verb_and_path) {
    return server_->WaitForStderr("req " + verb_and_path, 1, std::chrono::seconds(20));
  }
  // Waits until `n` requests whose "<VERB> <path>" contains `part` have arrived (e.g. the
  // Events, " /api/v1/namespaces/default/events", POSTs and PATCHes alike), whatever else the
  // agent asks meanwhile.
  bool WaitForRequestsWith(const std::string& part, int n) {
    return server_->WaitForStderr(part, n, std::chrono::seconds(20));
  }
  // How many requests whose "<VERB> <path>" contains `part` have arrived so far.
  int RequestsWith(const std::string& part) const { return server_->CountInStderr(part); }
  // Waits until `holds()` is true, looking again each time the double has handled a request
  // (no sleeping), for at most 20 s even while requests keep coming. (Counting requests that
  // arrived instead missed a change made by a request already counted but not yet handled,
  // and then waited for the next request: 20 s in a bench whose agent asked nothing more.)
  template <typename Holds>
  bool WaitUntil(Holds holds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    for (int seen = handled(); std::chrono::steady_clock::now() < deadline; ++seen) {
      if (holds()) return true;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !server_->WaitForStderr("done ", seen + 1, left)) break;
    }
    return holds();
  }
  int handled() const { return server_->CountInStderr("done "); }
  // Waits until the double has answered `n` requests "VERB:path" (e.g. "PATCH:/api/v1/nodes/n").
  bool WaitForAnswered(const std::string& verb_path, int n = 1) {
    return server_->WaitForStderr("done " + verb_path, n, std::chrono::seconds(20));
  }
  // Waits until `n` requests have arrived in total.
  bool WaitForRequests(int n) { return server_->WaitForStderr("req ", n, std::chrono::seconds(20)); }
  int requests() const { return server_->CountInStderr("req "); }
  // Each request as the JSON line the double logged.
  std::vector<std::string> Log() const {
    std::vector<std::string> lines;
    std::ifstream in(dir_ + "/requests.jsonl");
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  }

 private:
  std::string dir_;
  std::unique_ptr<Subprocess> server_;
  int port_ = 0;
  bool ok_ = false;
};

}  // namespace fusekeeper
