// metrics.h: Prometheus' text exposition format (version 0.0.4), written by hand.
//
// Defines swarm::metrics::Labels, Histogram (fixed buckets, in the metric's base unit), the
// bucket sets swarm uses, Exposition (families of samples, escaped and grouped as the format
// requires) and `process_metrics` (resident memory, CPU time and start time of this process,
// under the names Prometheus' own client libraries use). The router and the stage servers
// build their /metrics pages with it (router/metrics.h, stages/stage_metrics.h). Naming follows
// Prometheus' conventions: a `swarm_` prefix, base units (seconds, bytes) in the name, `_total`
// on counters; `promtool check metrics` is run on both pages by the tests.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace swarm::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Histogram {
 public:
  // bounds: bucket upper bounds, ascending; +Inf is implied.
  explicit Histogram(std::vector<double> bounds = {});
  void observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  // [bounds + 1] observations per bucket, not cumulative; the last one is above every bound.
  const std::vector<uint64_t>& counts() const { return counts_; }
  double sum() const { return sum_; }
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t count_ = 0;
};

std::vector<double> latency_buckets();    // [s] 1 ms .. 60 s: a hop, a request
std::vector<double> duration_buckets();   // [s] 10 ms .. 10 min: a round, a checkpoint write

enum class Type { kCounter, kGauge, kHistogram };

class Exposition {
 public:
  // Starts a family; its HELP and TYPE lines are written with its first sample (a family with
  // no sample writes nothing). Every sample of a family follows it before the next starts.
  Exposition& family(const std::string& name, Type type, const std::string& help);
  Exposition& sample(const Labels& labels, double value);
  // A histogram family's series: NAME_bucket{le=...} (cumulative), NAME_sum, NAME_count.
  Exposition& histogram(const Labels& labels, const Histogram& h);
  const std::string& text() const { return text_; }

 private:
  void header();
  std::string name_, help_;
  Type type_ = Type::kGauge;
  bool started_ = false;
  std::string text_;
};

// A value as the format writes it: integers exactly, NaN, +Inf and -Inf by name.
std::string format_value(double v);
// A label value with backslash, double quote and newline escaped.
std::string escape_label(const std::string& v);

// process_resident_memory_bytes, process_cpu_seconds_total, process_start_time_seconds (from
// /proc; nothing where it cannot be read).
void process_metrics(Exposition& out);

}  // namespace swarm::metrics
