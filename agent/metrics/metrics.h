// Metrics: a small Prometheus registry (text exposition format 0.0.4). Counters, gauges and
// histograms, each a family of series keyed by a rendered label set (`method="X",code="OK"`).
// Thread-safe: RPC latencies are recorded from gRPC threads, the rest from the loop. Gauges that
// mirror state are filled by collectors, which Render() runs first (on the caller's thread: the
// loop, where the state lives).
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace fusekeeper {

class Metrics {
 public:
  enum class Type { kCounter, kGauge, kHistogram };

  // Declares a family (before use). Histograms get `buckets` (upper bounds, ascending).
  void Define(const std::string& name, Type type, const std::string& help,
              std::vector<double> buckets = {});
  void Add(const std::string& name, const std::string& labels, double value = 1);
  void Set(const std::string& name, const std::string& labels, double value);
  void Observe(const std::string& name, const std::string& labels, double value);
  // Removes every series of a gauge family (a collector then sets the current ones).
  void ClearGauge(const std::string& name);
  void AddCollector(std::function<void(Metrics&)> collector);

  std::string Render();

  // One label pair, value escaped as the format requires.
  static std::string Label(absl::string_view name, absl::string_view value);

  static std::vector<double> LatencyBuckets();  // 50 µs .. 30 s

 private:
  struct Series {
    double value = 0;                 // counter / gauge
    std::vector<uint64_t> counts;     // histogram: per bucket (not cumulative)
    uint64_t count = 0;
    double sum = 0;
  };
  struct Family {
    Type type = Type::kCounter;
    std::string help;
    std::vector<double> buckets;
    std::map<std::string, Series> series;
  };
  Family* Find(const std::string& name);

  std::mutex mu_;
  std::map<std::string, Family> families_;
  std::vector<std::function<void(Metrics&)>> collectors_;
};

}  // namespace fusekeeper
