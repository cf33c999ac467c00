#include "agent/metrics/metrics.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fusekeeper {

void Metrics::Define(const std::string& name, Type type, const std::string& help, std::vector<double> buckets) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = families_[name];
  f.type = type;
  f.help = help;
  f.buckets = std::move(buckets);
}

Metrics::Family* Metrics::Find(const std::string& name) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    LOG(DFATAL) << "metric " << name << " used before it was defined";
    return nullptr;
  }
  return &it->second;
}

void Metrics::Add(const std::string& name, const std::string& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Family* f = Find(name)) f->series[labels].value += value;
}

void Metrics::Set(const std::string& name, const std::string& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Family* f = Find(name)) f->series[labels].value = value;
}

void Metrics::ClearGauge(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Family* f = Find(name)) f->series.clear();
}

void Metrics::Observe(const std::string& name, const std::string& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  Family* f = Find(name);
  if (f == nullptr) return;
  Series& s = f->series[labels];
  if (s.counts.empty()) s.counts.assign(f->buckets.size() + 1, 0);
  const size_t b = std::lower_bound(f->buckets.begin(), f->buckets.end(), value) - f->buckets.begin();
  ++s.counts[b];
  ++s.count;
  s.sum += value;
}

void Metrics::AddCollector(std::function<void(Metrics&)> collector) {
  std::lock_guard<std::mutex> lock(mu_);
  collectors_.push_back(std::move(collector));
}

std::string Metrics::Label(absl::string_view name, absl::string_view value) {
  std::string out = absl::StrCat(name, "=\"");
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out.push_back(c);
  }
  out.push_back('"');
  return out;
}

std::vector<double> Metrics::LatencyBuckets() {
  return {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,     0.25,   0.5,     1,      2.5,   5,      10,    30};
}

namespace {
std::string Braces(const std::string& labels, const std::string& extra = "") {
  if (labels.empty() && extra.empty()) return "";
  return absl::StrCat("{", labels, !labels.empty() && !extra.empty() ? "," : "", extra, "}");
}
std::string Number(double v) {
  if (v == static_cast<double>(static_cast<int64_t>(v)) && v < 1e15 && v > -1e15) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  return absl::StrCat(v);
}
}  // namespace

std::string Metrics::Render() {
  std::vector<std::function<void(Metrics&)>> collectors;
  {
    std::lock_guard<std::mutex> lock(mu_);
    collectors = collectors_;
  }
  for (auto& c : collectors) c(*this);
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    const char* type = f.type == Type::kCounter ? "counter" : f.type == Type::kGauge ? "gauge" : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", f.help, "\n# TYPE ", name, " ", type, "\n");
    for (const auto& [labels, s] : f.series) {
      if (f.type != Type::kHistogram) {
        absl::StrAppend(&out, name, Braces(labels), " ", Number(s.value), "\n");
        continue;
      }
      uint64_t cumulative = 0;
      for (size_t i = 0; i < f.buckets.size(); ++i) {
        cumulative += s.counts[i];
        absl::StrAppend(&out, name, "_bucket", Braces(labels, absl::StrCat("le=\"", f.buckets[i], "\"")), " ",
                        cumulative, "\n");
      }
      absl::StrAppend(&out, name, "_bucket", Braces(labels, "le=\"+Inf\""), " ", s.count, "\n");
      absl::StrAppend(&out, name, "_sum", Braces(labels), " ", s.sum, "\n");
      absl::StrAppend(&out, name, "_count", Braces(labels), " ", s.count, "\n");
    }
  }
  return out;
}

}  // namespace fusekeeper
