// EventRecorder: Kubernetes Events about pods, posted to the API server with client-go's
// semantics (k8s.io/client-go/tools/record):
//  - aggregation: more than `aggregate_max` events with the same (source, object, type, reason)
//    but different messages within `aggregate_window` become one event whose message starts with
//    "(combined from similar events): ";
//  - deduplication: a repeat of an event already posted (same source, object, type, reason and
//    message; LRU of `lru_size` keys) is a PATCH of its count and lastTimestamp, not a new event;
//  - spam filter: per (source, object, type) a token bucket of `burst` refilling one token per
//    `refill`; events without a token are dropped (counted);
//  - a bounded queue (`max_queue`); transport errors and 5xx/429 are retried with exponential
//    backoff up to `max_tries`; other 4xx are dropped with a log line (a 404 on PATCH posts anew).
// Everything runs on the loop; HTTP goes through the ring (HttpClient). Nothing blocks.
#pragma once

#include <deque>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/functional/any_invocable.h"

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/kube/api_config.h"
#include "agent/kube/http_client.h"
#include "agent/kube/token_file.h"
#include "agent/loop/blocking_pool.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

struct EventObject {
  std::string namespace_, name, uid;  // the pod
};

struct EventRecorderOptions {
  std::string component = "fusekeeper";
  std::string host;  // the node
  int burst = 25;
  absl::Duration refill = absl::Minutes(5);
  int aggregate_max = 10;
  absl::Duration aggregate_window = absl::Minutes(10);
  size_t lru_size = 4096;
  size_t max_queue = 1000;
  int max_in_flight = 4;
  int max_tries = 12;
  absl::Duration first_backoff = absl::Milliseconds(500);
  absl::Duration max_backoff = absl::Seconds(30);
  absl::Duration request_timeout = absl::Seconds(10);
};

class EventRecorder {
 public:
  struct Stats {
    int64_t posted = 0, patched = 0, spam_dropped = 0, queue_dropped = 0, failed = 0, retries = 0;
  };
  // `pool` reads the token file. All must outlive the recorder.
  EventRecorder(Loop& loop, HttpClient& http, BlockingPool& pool, KubeApiConfig api,
                EventRecorderOptions options);
  // Loop thread.
  void Record(const EventObject& pod, const std::string& type, const std::string& reason,
              const std::string& message);
  const Stats& stats() const { return stats_; }
  // Loop thread. `done` runs once nothing is queued, in flight or waiting for a retry.
  void WhenIdle(absl::AnyInvocable<void()> done);
  size_t queued() const { return queue_.size(); }

 private:
  struct Posted {  // an event the API server has
    std::string name;
    int count = 0;
    absl::Time first;
  };
  struct Work {
    EventObject pod;
    std::string type, reason, message;
    std::string dedup_key;
    int count = 1;
    absl::Time first, last;
    std::string name;  // non-empty: PATCH this event
    int tries = 0;
  };
  struct Bucket {
    double tokens;
    absl::Time last;
  };
  struct Aggregate {
    std::map<std::string, absl::Time> messages;  // distinct messages seen in the window
  };
  void Pump();
  void SendOne(std::shared_ptr<Work> w);
  void Retry(std::shared_ptr<Work> w, const std::string& why);
  void SendQueued();
  std::string EventJson(const Work& w) const;
  void Touch(const std::string& key, Posted posted);

  Loop& loop_;
  HttpClient& http_;
  const KubeApiConfig api_;
  const EventRecorderOptions options_;
  TokenFile token_;
  std::deque<std::shared_ptr<Work>> queue_;
  int in_flight_ = 0;
  int retries_waiting_ = 0;
  Timers retry_timers_;  // retries waiting for their backoff
  std::unordered_set<std::string> busy_names_;  // events with a request in flight
  std::vector<absl::AnyInvocable<void()>> idle_waiters_;
  void MaybeIdle();
  std::unordered_map<std::string, Bucket> buckets_;
  std::unordered_map<std::string, Aggregate> aggregates_;
  // LRU of posted events by dedup key.
  std::list<std::string> lru_;
  std::unordered_map<std::string, std::pair<Posted, std::list<std::string>::iterator>> posted_;
  Stats stats_;
  uint64_t sequence_ = 0;
};

}  // namespace fusekeeper
