#include "agent/kubelet/kubelet_poller.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fusekeeper {

KubeletPoller::KubeletPoller(Loop& loop, HttpClient& http, BlockingPool& pool, KubeletPollerOptions options,
                             OnRestart on_restart, OnError on_error)
    : loop_(loop),
      http_(http),
      options_(std::move(options)),
      token_(pool, options_.token_file, absl::Minutes(1)),
      on_restart_(std::move(on_restart)),
      on_error_(std::move(on_error)),
      next_poll_(loop) {}

void KubeletPoller::Start() { Poll(); }

void KubeletPoller::Schedule(absl::Duration after) {
  next_poll_.Arm(absl::ToChronoNanoseconds(after), [this] { Poll(); });
}

void KubeletPoller::Poll() {
  in_flight_ = true;
  token_.Refresh([this] { Send(); });
}

void KubeletPoller::PollNow(std::function<void()> done) {
  waiting_.push_back(std::move(done));
  if (in_flight_) return;  // Answered sends the next one
  next_poll_.Cancel();
  Poll();
}

void KubeletPoller::Answered(std::vector<std::function<void()>> callers) {
  in_flight_ = false;
  for (auto& done : callers) done();
  if (!waiting_.empty()) {
    next_poll_.Cancel();
    Poll();
  }
}

void KubeletPoller::Send() {
  HttpRequest r;
  r.url = options_.url;
  r.ca_file = options_.ca_file;
  r.insecure = options_.insecure;
  r.timeout = options_.timeout;
  if (!token_.value().empty()) r.headers.push_back(absl::StrCat("Authorization: Bearer ", token_.value()));
  ++polls_;
  // Whoever asked before this request left is answered by it; later callers by the next.
  http_.Send(std::move(r), [this, callers = std::exchange(waiting_, {})](absl::StatusOr<HttpResult> res) mutable {
    std::string why;
    if (!res.ok()) {
      why = std::string(res.status().message());
    } else if (res->status != 200) {
      why = absl::StrCat("HTTP ", res->status,
                         res->status == 401 || res->status == 403
                             ? " (the service account needs nodes/proxy or nodes/pods get)"
                             : "");
    } else if (auto pods = ParsePodList(res->body); !pods.ok()) {
      why = std::string(pods.status().message());
    } else {
      backoff_ = absl::ZeroDuration();
      if (failing_polls_ > 0) {
        LOG(INFO) << "the kubelet at " << options_.url << " answers again, after " << failing_polls_
                  << " failed poll(s) over " << absl::FormatDuration(absl::Trunc(absl::Now() - failing_since_, absl::Seconds(1)));
        failing_polls_ = 0;
      }
      for (const ContainerRestart& c : detector_.Update(*pods)) on_restart_(c);
      if (on_pods_) on_pods_(*pods);
      Schedule(options_.period);
      return Answered(std::move(callers));
    }
    ++errors_;
    // A kubelet that is not listening (down, restarting, the agent started first) costs nothing
    // to ask again: keep the normal period, so container restarts are seen as soon as it is
    // back. Only a kubelet that answers badly (or slowly) is backed off from.
    const bool not_listening = !res.ok() && absl::IsUnavailable(res.status()) &&
                               (absl::StrContains(res.status().message(), "onnect") ||
                                absl::StrContains(res.status().message(), "refused"));
    if (not_listening) {
      backoff_ = std::min(options_.outage_retry, options_.period);
    } else {
      backoff_ = backoff_ == absl::ZeroDuration() ? options_.period : std::min(backoff_ * 2, options_.max_backoff);
    }
    if (failing_polls_++ == 0) {
      failing_since_ = absl::Now();
      LOG(WARNING) << "polling the kubelet at " << options_.url << ": " << why << "; asking again in " << backoff_
                   << (not_listening ? "" : absl::StrCat(", then backing off up to ", absl::FormatDuration(options_.max_backoff)))
                   << " (recovery still works from mount-table and FUSE connection events; failed polls "
                      "are counted in fusekeeper_kubelet_poll_errors_total)";
    } else {
      VLOG(1) << "polling the kubelet at " << options_.url << ": " << why << "; next try in " << backoff_;
    }
    if (on_error_) on_error_(why);
    Schedule(backoff_);
    Answered(std::move(callers));
  });
}

}  // namespace fusekeeper
