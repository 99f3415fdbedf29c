// metrics.cpp: the Prometheus text exposition writer and the process's own figures (metrics.h).
#include "runtime/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "runtime/errors.h"

namespace swarm::metrics {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  SWARM_CHECK(std::is_sorted(bounds_.begin(), bounds_.end()), "histogram bounds must ascend");
}

void Histogram::observe(double v) {
  if (std::isnan(v)) return;
  const size_t i = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());  // le: v <= bound
  counts_[i]++;
  sum_ += v;
  count_++;
}

std::vector<double> latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}
std::vector<double> duration_buckets() {
  return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) {  // below 2^53: an integer, exactly
    std::snprintf(buf, sizeof(buf), "%.0f", v);
    return buf;
  }
  // The shortest form that reads back as the same double (0.1, not 0.10000000000000001).
  for (int digits = 15; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string escape_label(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char ch : v) {
    if (ch == '\\') out += "\\\\";
    else if (ch == '"') out += "\\\"";
    else if (ch == '\n') out += "\\n";
    else out += ch;
  }
  return out;
}

namespace {

std::string escape_help(const std::string& v) {
  std::string out;
  for (char ch : v) {
    if (ch == '\\') out += "\\\\";
    else if (ch == '\n') out += "\\n";
    else out += ch;
  }
  return out;
}

void write_labels(std::string& out, const Labels& labels, const char* extra_name = nullptr, const std::string& extra = "") {
  if (labels.empty() && !extra_name) return;
  out += '{';
  bool first = true;
  for (const auto& [k, v] : labels) {
    if (!first) out += ',';
    first = false;
    out += k + "=\"" + escape_label(v) + "\"";
  }
  if (extra_name) {
    if (!first) out += ',';
    out += std::string(extra_name) + "=\"" + extra + "\"";
  }
  out += '}';
}

}  // namespace

Exposition& Exposition::family(const std::string& name, Type type, const std::string& help) {
  name_ = name;
  type_ = type;
  help_ = help;
  started_ = false;
  return *this;
}

void Exposition::header() {
  if (started_) return;
  started_ = true;
  static const char* types[] = {"counter", "gauge", "histogram"};
  text_ += "# HELP " + name_ + " " + escape_help(help_) + "\n# TYPE " + name_ + " " + types[int(type_)] + "\n";
}

Exposition& Exposition::sample(const Labels& labels, double value) {
  SWARM_CHECK(!name_.empty() && type_ != Type::kHistogram, "a sample needs a counter or gauge family first");
  header();
  text_ += name_;
  write_labels(text_, labels);
  text_ += ' ' + format_value(value) + '\n';
  return *this;
}

Exposition& Exposition::histogram(const Labels& labels, const Histogram& h) {
  SWARM_CHECK(type_ == Type::kHistogram, "histogram samples need a histogram family");
  header();
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= h.bounds().size(); ++i) {
    cumulative += h.counts()[i];
    text_ += name_ + "_bucket";
    write_labels(text_, labels, "le", i < h.bounds().size() ? format_value(h.bounds()[i]) : "+Inf");
    text_ += ' ' + format_value(double(cumulative)) + '\n';
  }
  text_ += name_ + "_sum";
  write_labels(text_, labels);
  text_ += ' ' + format_value(h.sum()) + '\n';
  text_ += name_ + "_count";
  write_labels(text_, labels);
  text_ += ' ' + format_value(double(h.count())) + '\n';
  return *this;
}

void process_metrics(Exposition& out) {
  const double tick = double(sysconf(_SC_CLK_TCK));
  const double page = double(sysconf(_SC_PAGESIZE));
  {
    std::ifstream f("/proc/self/statm");
    uint64_t size = 0, resident = 0;
    if (f >> size >> resident)
      out.family("process_resident_memory_bytes", Type::kGauge, "Resident memory size in bytes.").sample({}, double(resident) * page);
  }
  std::ifstream f("/proc/self/stat");
  std::string line;
  if (!std::getline(f, line)) return;
  // Fields after the command name (which may hold spaces), counted from field 3 (state).
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return;
  std::istringstream rest(line.substr(close + 2));
  std::vector<std::string> fields;
  for (std::string x; rest >> x;) fields.push_back(x);
  if (fields.size() < 20) return;
  // utime, stime: fields 14 and 15; starttime: field 22 (ticks after boot).
  const double cpu = (std::stod(fields[11]) + std::stod(fields[12])) / tick;
  out.family("process_cpu_seconds_total", Type::kCounter, "Total user and system CPU time spent in seconds.").sample({}, cpu);
  std::ifstream st("/proc/stat");
  for (std::string l; std::getline(st, l);) {
    if (l.rfind("btime ", 0) != 0) continue;
    const double boot = std::stod(l.substr(6));
    out.family("process_start_time_seconds", Type::kGauge, "Start time of the process since unix epoch in seconds.")
        .sample({}, boot + std::stod(fields[19]) / tick);
    break;
  }
}

}  // namespace swarm::metrics
