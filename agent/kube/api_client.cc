#include "agent/kube/api_client.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fusekeeper {

ApiClient::ApiClient(HttpClient& http, BlockingPool& pool, KubeApiConfig api, absl::Duration timeout)
    : http_(http), api_(std::move(api)), timeout_(timeout), token_(pool, api_.token_file, absl::Seconds(10)) {}

void ApiClient::Send(std::string method, std::string path, std::string body, Done done, std::string content_type) {
  token_.Refresh([this, alive = alive_.token(), method = std::move(method), path = std::move(path), body = std::move(body),
                  done = std::move(done), content_type = std::move(content_type)]() mutable {
    if (!alive.alive()) return;
    HttpRequest r;
    r.method = std::move(method);
    r.url = absl::StrCat(api_.base_url, path);
    if (!body.empty()) r.headers.push_back(absl::StrCat("Content-Type: ", content_type));
    r.headers.push_back("Accept: application/json");
    if (!token_.value().empty()) r.headers.push_back(absl::StrCat("Authorization: Bearer ", token_.value()));
    r.body = std::move(body);
    r.ca_file = api_.ca_file;
    r.insecure = api_.insecure;
    r.timeout = timeout_;
    http_.Send(std::move(r), [alive, done = std::move(done)](absl::StatusOr<HttpResult> res) mutable {
      if (alive.alive()) done(std::move(res));
    });
  });
}

}  // namespace fusekeeper
