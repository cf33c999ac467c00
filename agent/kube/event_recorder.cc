#include "agent/kube/event_recorder.h"

#include <stdlib.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "agent/base/json.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

std::string Rfc3339(absl::Time t) { return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", t, absl::UTCTimeZone()); }


}  // namespace

EventRecorder::EventRecorder(Loop& loop, HttpClient& http, BlockingPool& pool, KubeApiConfig api,
                             EventRecorderOptions options)
    : loop_(loop),
      http_(http),
      api_(std::move(api)),
      options_(std::move(options)),
      token_(pool, api_.token_file, absl::Seconds(10)),
      retry_timers_(loop) {}

void EventRecorder::Touch(const std::string& key, Posted posted) {
  auto it = posted_.find(key);
  if (it != posted_.end()) {
    lru_.erase(it->second.second);
    posted_.erase(it);
  }
  lru_.push_front(key);
  posted_[key] = {std::move(posted), lru_.begin()};
  while (posted_.size() > options_.lru_size) {
    posted_.erase(lru_.back());
    lru_.pop_back();
  }
}

void EventRecorder::Record(const EventObject& pod, const std::string& type, const std::string& reason,
                           const std::string& message) {
  const absl::Time now = absl::Now();
  const std::string source = absl::StrCat(options_.component, "\x1f", options_.host);
  const std::string object = absl::StrCat(pod.namespace_, "\x1f", pod.name, "\x1f", pod.uid);
  // Aggregation: many distinct messages for the same reason become one combined event.
  std::string msg = message;
  const std::string agg_key = absl::StrCat(source, "\x1e", object, "\x1e", type, "\x1e", reason);
  Aggregate& agg = aggregates_[agg_key];
  for (auto it = agg.messages.begin(); it != agg.messages.end();) {
    it = now - it->second > options_.aggregate_window ? agg.messages.erase(it) : std::next(it);
  }
  agg.messages[message] = now;
  std::string dedup_key = absl::StrCat(agg_key, "\x1e", message);
  if (static_cast<int>(agg.messages.size()) >= options_.aggregate_max) {
    msg = absl::StrCat("(combined from similar events): ", message);
    dedup_key = agg_key;  // every further one is a count update of the combined event
  }
  // Deduplication: a repeat is a count update of the event already posted.
  auto w = std::make_shared<Work>();
  w->pod = pod;
  w->type = type;
  w->reason = reason;
  w->message = msg;
  w->dedup_key = dedup_key;
  w->first = w->last = now;
  auto seen = posted_.find(dedup_key);
  if (seen != posted_.end()) {
    Posted p = seen->second.first;
    p.count += 1;
    w->count = p.count;
    w->first = p.first;
    w->name = p.name;
    Touch(dedup_key, p);
  } else {
    w->name.clear();
    Posted p;
    p.name = absl::StrCat(pod.name.empty() ? "pod" : pod.name, ".", absl::Hex(absl::ToUnixNanos(now)), absl::Hex(++sequence_));
    p.count = 1;
    p.first = now;
    Touch(dedup_key, p);
    w->name = p.name;
    w->count = 0;  // 0: POST (a new event named w->name)
  }
  // Spam filter: per (source, object, type), a token bucket.
  Bucket& b = buckets_.emplace(absl::StrCat(source, "\x1e", object, "\x1e", type),
                               Bucket{static_cast<double>(options_.burst), now}).first->second;
  b.tokens = std::min<double>(options_.burst, b.tokens + absl::FDivDuration(now - b.last, options_.refill));
  b.last = now;
  if (b.tokens < 1) {
    ++stats_.spam_dropped;
    VLOG(1) << "event " << reason << " for pod " << pod.namespace_ << "/" << pod.name << " dropped by the spam filter";
    return;
  }
  b.tokens -= 1;
  if (queue_.size() >= options_.max_queue) {
    ++stats_.queue_dropped;
    LOG(WARNING) << "event queue full (" << options_.max_queue << "); dropping " << reason << " for pod "
                 << pod.namespace_ << "/" << pod.name;
    return;
  }
  queue_.push_back(std::move(w));
  Pump();
}

void EventRecorder::WhenIdle(absl::AnyInvocable<void()> done) {
  idle_waiters_.push_back(std::move(done));
  MaybeIdle();
}

void EventRecorder::MaybeIdle() {
  if (!queue_.empty() || in_flight_ > 0 || retries_waiting_ > 0) return;
  auto waiters = std::move(idle_waiters_);
  idle_waiters_.clear();
  for (auto& w : waiters) w();
}

void EventRecorder::Pump() {
  token_.Refresh([this] { SendQueued(); });
}

void EventRecorder::SendQueued() {
  if (token_.value().empty() && !token_.path().empty()) return;  // no token yet: after the next read
  // Requests about one event go one at a time, in order (a PATCH must not overtake its POST).
  for (auto it = queue_.begin(); in_flight_ < options_.max_in_flight && it != queue_.end();) {
    if (busy_names_.count((*it)->name) > 0) {
      ++it;
      continue;
    }
    std::shared_ptr<Work> w = std::move(*it);
    it = queue_.erase(it);
    SendOne(std::move(w));
  }
  MaybeIdle();
}

std::string EventRecorder::EventJson(const Work& w) const {
  return absl::StrCat(
      "{\"apiVersion\":\"v1\",\"kind\":\"Event\",\"metadata\":{\"name\":", JsonQuote(w.name),
      ",\"namespace\":", JsonQuote(w.pod.namespace_), "},\"involvedObject\":{\"apiVersion\":\"v1\",\"kind\":\"Pod\","
      "\"namespace\":", JsonQuote(w.pod.namespace_), ",\"name\":", JsonQuote(w.pod.name), ",\"uid\":", JsonQuote(w.pod.uid),
      "},\"reason\":", JsonQuote(w.reason), ",\"message\":", JsonQuote(w.message), ",\"type\":", JsonQuote(w.type),
      ",\"source\":{\"component\":", JsonQuote(options_.component), ",\"host\":", JsonQuote(options_.host),
      // As client-go's recorder fills them (ReportingController / ReportingInstance).
      "},\"reportingComponent\":", JsonQuote(options_.component), ",\"reportingInstance\":", JsonQuote(options_.host),
      ",\"firstTimestamp\":\"", Rfc3339(w.first), "\",\"lastTimestamp\":\"", Rfc3339(w.last), "\",\"count\":",
      std::max(w.count, 1), "}");
}

void EventRecorder::SendOne(std::shared_ptr<Work> w) {
  ++in_flight_;
  busy_names_.insert(w->name);
  HttpRequest r;
  const bool patch = w->count > 0;
  const std::string base = absl::StrCat(api_.base_url, "/api/v1/namespaces/", w->pod.namespace_, "/events");
  if (patch) {
    r.method = "PATCH";
    r.url = absl::StrCat(base, "/", w->name);
    r.headers.push_back("Content-Type: application/strategic-merge-patch+json");
    r.body = absl::StrCat("{\"count\":", w->count, ",\"lastTimestamp\":\"", Rfc3339(w->last), "\",\"message\":",
                          JsonQuote(w->message), "}");
  } else {
    r.method = "POST";
    r.url = base;
    r.headers.push_back("Content-Type: application/json");
    r.body = EventJson(*w);
  }
  if (!token_.value().empty()) r.headers.push_back(absl::StrCat("Authorization: Bearer ", token_.value()));
  r.ca_file = api_.ca_file;
  r.insecure = api_.insecure;
  r.timeout = options_.request_timeout;
  http_.Send(std::move(r), [this, w, patch](absl::StatusOr<HttpResult> res) {
    --in_flight_;
    busy_names_.erase(w->name);
    if (!res.ok()) {
      Retry(w, std::string(res.status().message()));
    } else if (res->status >= 200 && res->status < 300) {
      ++(patch ? stats_.patched : stats_.posted);
    } else if (patch && res->status == 404) {
      w->count = 0;  // the event expired on the server: post it anew
      queue_.push_front(w);
    } else if (res->status >= 500 || res->status == 429) {
      Retry(w, absl::StrCat("HTTP ", res->status));
    } else {
      ++stats_.failed;
      LOG(WARNING) << "the API server refused event " << w->reason << " for pod " << w->pod.namespace_ << "/"
                   << w->pod.name << ": HTTP " << res->status
                   << (res->status == 401 || res->status == 403 ? " (check the service account's RBAC: events create/patch)" : "");
    }
    Pump();
  });
}

void EventRecorder::Retry(std::shared_ptr<Work> w, const std::string& why) {
  if (++w->tries >= options_.max_tries) {
    ++stats_.failed;
    LOG(WARNING) << "giving up on event " << w->reason << " for pod " << w->pod.namespace_ << "/" << w->pod.name
                 << " after " << w->tries << " tries: " << why;
    return;
  }
  ++stats_.retries;
  absl::Duration d = options_.first_backoff;
  for (int i = 1; i < w->tries && d < options_.max_backoff; ++i) d *= 2;
  d = std::min(d, options_.max_backoff);
  VLOG(1) << "event " << w->reason << ": " << why << "; retrying in " << d;
  ++retries_waiting_;
  retry_timers_.Add(absl::ToChronoNanoseconds(d), [this, w] {
    --retries_waiting_;
    queue_.push_front(w);
    Pump();
  });
}

}  // namespace fusekeeper
