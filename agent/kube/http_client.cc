#include "agent/kube/http_client.h"

#include <curl/curl.h>
#include <poll.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fusekeeper {

struct HttpClient::Transfer {
  CURL* easy = nullptr;
  curl_slist* headers = nullptr;
  HttpRequest request;
  std::string body;
  bool too_large = false;
  Done done;
  char error[CURL_ERROR_SIZE] = {0};
  ~Transfer() {
    if (headers != nullptr) curl_slist_free_all(headers);
    if (easy != nullptr) curl_easy_cleanup(easy);
  }
};

// One socket curl wants watched: a single-shot poll re-armed after each event.
struct HttpClient::Watch {
  int fd = -1;
  int what = 0;  // CURL_POLL_IN / OUT / INOUT
  bool armed = false;
  bool retired = false;
  bool rearm = false;  // cancelled for a mask change
  Completion poll;
};


absl::StatusOr<std::unique_ptr<HttpClient>> HttpClient::Create(Loop& loop) {
  static const CURLcode global = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (global != CURLE_OK) return absl::InternalError("curl_global_init failed");
  std::unique_ptr<HttpClient> c(new HttpClient(loop));
  c->multi_ = curl_multi_init();
  if (c->multi_ == nullptr) return absl::InternalError("curl_multi_init failed");
  curl_multi_setopt(c->multi_, CURLMOPT_SOCKETFUNCTION, &HttpClient::OnSocket);
  curl_multi_setopt(c->multi_, CURLMOPT_SOCKETDATA, c.get());
  curl_multi_setopt(c->multi_, CURLMOPT_TIMERFUNCTION, &HttpClient::OnTimer);
  curl_multi_setopt(c->multi_, CURLMOPT_TIMERDATA, c.get());
  return c;
}

HttpClient::HttpClient(Loop& loop) : loop_(loop), timer_(loop) {}

HttpClient::~HttpClient() {
  // The loop has stopped: curl must not call back into it while transfers are torn down.
  if (multi_ != nullptr) {
    curl_multi_setopt(multi_, CURLMOPT_SOCKETFUNCTION, nullptr);
    curl_multi_setopt(multi_, CURLMOPT_TIMERFUNCTION, nullptr);
  }
  for (auto& [easy, t] : transfers_) curl_multi_remove_handle(multi_, t->easy);
  transfers_.clear();
  if (multi_ != nullptr) curl_multi_cleanup(multi_);
}

void HttpClient::Send(HttpRequest request, Done done) {
  auto t = std::make_unique<Transfer>();
  t->request = std::move(request);
  t->done = std::move(done);
  t->easy = curl_easy_init();
  if (t->easy == nullptr) return t->done(absl::InternalError("curl_easy_init failed"));
  CURL* e = t->easy;
  curl_easy_setopt(e, CURLOPT_URL, t->request.url.c_str());
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t->error);
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, static_cast<long>(absl::ToInt64Milliseconds(t->request.timeout)));
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(absl::ToInt64Milliseconds(t->request.timeout)));
  curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "https,http");
  curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
  if (t->request.insecure) {
    curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, 0L);
    curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, 0L);
  } else if (!t->request.ca_file.empty()) {
    curl_easy_setopt(e, CURLOPT_CAINFO, t->request.ca_file.c_str());
  }
  for (const auto& h : t->request.headers) t->headers = curl_slist_append(t->headers, h.c_str());
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, t->headers);
  if (t->request.method != "GET") {
    curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, t->request.method.c_str());
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, t->request.body.data());
    curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE, static_cast<long>(t->request.body.size()));
  }
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, +[](char* data, size_t size, size_t n, void* user) -> size_t {
    auto* tr = static_cast<Transfer*>(user);
    if (tr->body.size() + size * n > tr->request.max_response_bytes) {
      tr->too_large = true;
      return 0;  // aborts the transfer
    }
    tr->body.append(data, size * n);
    return size * n;
  });
  curl_easy_setopt(e, CURLOPT_WRITEDATA, t.get());
  transfers_[e] = std::move(t);
  if (CURLMcode m = curl_multi_add_handle(multi_, e); m != CURLM_OK) {
    auto owned = std::move(transfers_[e]);
    transfers_.erase(e);
    return owned->done(absl::InternalError(absl::StrCat("curl_multi_add_handle: ", curl_multi_strerror(m))));
  }
}

int HttpClient::OnSocket(void* /*easy*/, int fd, int what, void* self_ptr, void* /*socketp*/) {
  auto* self = static_cast<HttpClient*>(self_ptr);
  auto it = self->watches_.find(fd);
  if (what == CURL_POLL_REMOVE) {
    if (it != self->watches_.end()) {
      Watch* w = it->second.get();
      w->retired = true;
      if (w->armed) {
        // Freed by its own (cancelled) completion.
        self->loop_.Cancel(&w->poll);
        self->retired_.push_back(std::move(it->second));
      } else {
        // Possibly inside this watch's callback right now: freed after it returns.
        std::shared_ptr<Watch> doomed(std::move(it->second));
        self->loop_.Post([doomed] {});
      }
      self->watches_.erase(it);
    }
    return 0;
  }
  if (it == self->watches_.end()) {
    auto w = std::make_unique<Watch>();
    w->fd = fd;
    Watch* raw = w.get();
    w->poll.callback = [self, raw](int32_t res, bool) {
      raw->armed = false;
      if (raw->retired) {
        // Freed after this callback has returned.
        for (auto r = self->retired_.begin(); r != self->retired_.end(); ++r) {
          if (r->get() == raw) {
            std::shared_ptr<Watch> doomed(std::move(*r));
            self->retired_.erase(r);
            self->loop_.Post([doomed] {});
            break;
          }
        }
        return;
      }
      if (res == -ECANCELED) {
        // Cancelled for a mask change: arm again with the new mask (not when the loop stops).
        if (std::exchange(raw->rearm, false) && self->loop_.running()) self->Arm(raw);
        return;
      }
      int events = 0;
      if (res < 0) {
        events = CURL_CSELECT_ERR;
      } else {
        if (res & (POLLIN | POLLHUP)) events |= CURL_CSELECT_IN;
        if (res & POLLOUT) events |= CURL_CSELECT_OUT;
        if (res & POLLERR) events |= CURL_CSELECT_ERR;
      }
      const int fd = raw->fd;
      self->Action(fd, events);
      // Still wanted (not removed during the action) and not re-armed: watch again.
      auto again = self->watches_.find(fd);
      if (again != self->watches_.end() && again->second.get() == raw && !raw->armed) self->Arm(raw);
    };
    it = self->watches_.emplace(fd, std::move(w)).first;
  }
  Watch* w = it->second.get();
  const bool changed = w->what != what;
  w->what = what;
  if (!w->armed) {
    self->Arm(w);
  } else if (changed) {
    w->rearm = true;
    self->loop_.Cancel(&w->poll);  // re-armed with the new mask by its callback
  }
  return 0;
}

void HttpClient::Arm(Watch* w) {
  unsigned mask = 0;
  if (w->what & CURL_POLL_IN) mask |= POLLIN;
  if (w->what & CURL_POLL_OUT) mask |= POLLOUT;
  io_uring_sqe* sqe = loop_.GetSqe();
  io_uring_prep_poll_add(sqe, w->fd, mask);
  w->armed = true;
  loop_.Arm(sqe, &w->poll);
}

int HttpClient::OnTimer(void* /*multi*/, long timeout_ms, void* self_ptr) {
  auto* self = static_cast<HttpClient*>(self_ptr);
  self->timer_.Cancel();
  if (timeout_ms < 0) return 0;
  // (Action may ask for the timer again: re-arming from its own callback is allowed.)
  self->timer_.Arm(std::chrono::milliseconds(timeout_ms), [self] { self->Action(CURL_SOCKET_TIMEOUT, 0); });
  return 0;
}

void HttpClient::Action(int fd, int events) {
  int running = 0;
  curl_multi_socket_action(multi_, fd, events, &running);
  Reap();
}

void HttpClient::Reap() {
  CURLMsg* msg;
  int left = 0;
  while ((msg = curl_multi_info_read(multi_, &left)) != nullptr) {
    if (msg->msg != CURLMSG_DONE) continue;
    CURL* e = msg->easy_handle;
    const CURLcode code = msg->data.result;
    curl_multi_remove_handle(multi_, e);
    auto it = transfers_.find(e);
    if (it == transfers_.end()) continue;
    std::unique_ptr<Transfer> t = std::move(it->second);
    transfers_.erase(it);
    if (t->too_large) {
      t->done(absl::ResourceExhaustedError(absl::StrCat(t->request.url, ": response larger than ",
                                                        t->request.max_response_bytes, " bytes")));
    } else if (code != CURLE_OK) {
      const std::string why = t->error[0] ? t->error : curl_easy_strerror(code);
      t->done(code == CURLE_OPERATION_TIMEDOUT
                  ? absl::DeadlineExceededError(absl::StrCat(t->request.url, ": ", why))
                  : absl::UnavailableError(absl::StrCat(t->request.url, ": ", why)));
    } else {
      HttpResult r;
      curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &r.status);
      r.body = std::move(t->body);
      t->done(std::move(r));
    }
  }
}

}  // namespace fusekeeper
