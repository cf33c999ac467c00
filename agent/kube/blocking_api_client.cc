#include "agent/kube/blocking_api_client.h"

#include <httplib.h>

#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace fusekeeper {
namespace {

std::string ReadToken(const std::string& file) {
  if (file.empty()) return "";
  std::ifstream in(file);
  std::stringstream s;
  s << in.rdbuf();
  std::string t = s.str();
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  return t;
}

absl::StatusOr<std::unique_ptr<httplib::Client>> Connect(const BlockingApiOptions& o, const std::string& what) {
  // httplib would speak plain HTTP to an http:// URL, and send the token in the clear.
  if (!absl::StartsWith(o.base_url, "https://")) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the API server's URL must be https://, not '", o.base_url, "'"));
  }
  auto c = std::make_unique<httplib::Client>(o.base_url);
  if (!o.ca_file.empty()) c->set_ca_cert_path(o.ca_file.c_str());
  c->enable_server_certificate_verification(true);
  const auto timeout = absl::ToChronoMilliseconds(o.timeout);
  c->set_connection_timeout(timeout);
  c->set_read_timeout(timeout);
  c->set_write_timeout(timeout);
  if (const std::string token = ReadToken(o.token_file); !token.empty()) c->set_bearer_token_auth(token.c_str());
  return c;
}

}  // namespace

absl::StatusOr<ApiAnswer> BlockingApiClient::Get(const std::string& path) const {
  const std::string what = absl::StrCat("GET ", options_.base_url, path);
  auto c = Connect(options_, what);
  if (!c.ok()) return c.status();
  ApiAnswer answer;
  bool too_big = false;
  const httplib::Result r = (*c)->Get(path, [&](const char* data, size_t n) {
    if (answer.body.size() + n > options_.max_answer_bytes) {
      too_big = true;
      return false;
    }
    answer.body.append(data, n);
    return true;
  });
  if (too_big) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": the answer is over ", options_.max_answer_bytes, " bytes"));
  }
  if (!r) return absl::UnavailableError(absl::StrCat(what, ": ", httplib::to_string(r.error())));
  answer.status = r->status;
  return answer;
}

absl::StatusOr<ApiAnswer> BlockingApiClient::Patch(const std::string& path, const std::string& body,
                                                   const std::string& content_type) const {
  const std::string what = absl::StrCat("PATCH ", options_.base_url, path);
  auto c = Connect(options_, what);
  if (!c.ok()) return c.status();
  const httplib::Result r = (*c)->Patch(path, body, content_type);
  if (!r) return absl::UnavailableError(absl::StrCat(what, ": ", httplib::to_string(r.error())));
  if (r->body.size() > options_.max_answer_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": the answer is over ", options_.max_answer_bytes, " bytes"));
  }
  return ApiAnswer{r->status, r->body};
}

}  // namespace fusekeeper
