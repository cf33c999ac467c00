// KubeletPoller: GET <kubelet>/pods every `period` through the ring (HttpClient), with the
// service account token (re-read each minute) and the kubelet's CA or an explicit insecure
// opt-in. Each PodList feeds a RestartDetector; restarts go to `on_restart` on the loop thread.
// A kubelet that is not listening (down, restarting, started after the agent) is asked again
// every outage_retry, so it is polled within seconds of coming back; one that is slow, refusing
// (401/403) or answering garbage is backed off from, doubling up to max_backoff. Either costs a
// metric per failed poll and one log line when polls start failing and one when they work
// again — never a stall, never a spin.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "agent/kube/http_client.h"
#include "agent/kubelet/pod_list.h"
#include "agent/kube/token_file.h"
#include "agent/loop/blocking_pool.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

struct KubeletPollerOptions {
  std::string url;           // https://<node ip>:10250/pods
  std::string token_file;    // empty: no Authorization header
  std::string ca_file;       // empty: system CAs
  bool insecure = false;
  absl::Duration period = absl::Seconds(10);
  absl::Duration timeout = absl::Seconds(5);
  absl::Duration outage_retry = absl::Seconds(3);  // at most `period`
  absl::Duration max_backoff = absl::Seconds(30);
};

class KubeletPoller {
 public:
  using OnRestart = std::function<void(const ContainerRestart&)>;
  using OnError = std::function<void(const std::string& why)>;
  KubeletPoller(Loop& loop, HttpClient& http, BlockingPool& pool, KubeletPollerOptions options,
                OnRestart on_restart, OnError on_error = nullptr);
  // Loop thread. Every PodList read also goes to `on_pods` (set before Start).
  void set_on_pods(std::function<void(const std::vector<PodStatus>&)> on_pods) { on_pods_ = std::move(on_pods); }
  // Loop thread.
  void Start();
  // Loop thread. A poll sent now (or, with one in flight, right after it: that one may have left
  // before what the caller wants to see), then `done`, once its answer or error has been taken
  // in. Callers that come while one waits share the next poll.
  void PollNow(std::function<void()> done);
  int64_t polls() const { return polls_; }
  int64_t errors() const { return errors_; }
  // The wait before the next poll after an error (loop thread).
  absl::Duration backoff() const { return backoff_; }

 private:
  void Poll();
  void Send();
  void Schedule(absl::Duration after);
  // After a poll's answer (or error): its PollNow callers are told, and a poll asked for while
  // it was in flight is sent.
  void Answered(std::vector<std::function<void()>> callers);

  Loop& loop_;
  HttpClient& http_;
  const KubeletPollerOptions options_;
  TokenFile token_;
  OnRestart on_restart_;
  OnError on_error_;
  std::function<void(const std::vector<PodStatus>&)> on_pods_;
  RestartDetector detector_;
  absl::Duration backoff_ = absl::ZeroDuration();
  int64_t polls_ = 0, errors_ = 0;
  int64_t failing_polls_ = 0;  // in a row, since the last good answer
  absl::Time failing_since_;
  Timer next_poll_;
  bool in_flight_ = false;  // from Poll until its answer is handled
  std::vector<std::function<void()>> waiting_;  // PollNow callers for the next poll sent
};

}  // namespace fusekeeper
