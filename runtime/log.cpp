// log.cpp: the stderr logger in text or JSON lines (see log.h).
#include "runtime/log.h"

#include <sys/time.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>

#include <nlohmann/json.hpp>

#include "runtime/errors.h"

namespace swarm {

namespace {

LogLevel threshold() {
  static const LogLevel level = [] {
    const char* e = std::getenv("SWARM_LOG");
    if (!e) return LogLevel::kInfo;
    if (!std::strcmp(e, "debug")) return LogLevel::kDebug;
    if (!std::strcmp(e, "warn")) return LogLevel::kWarn;
    if (!std::strcmp(e, "error")) return LogLevel::kError;
    return LogLevel::kInfo;
  }();
  return level;
}

std::atomic<LogFormat> g_format{LogFormat::kText};
std::atomic<uint64_t> g_job{0};
std::mutex g_peer_mu;
std::string g_peer;

const char* text_name(LogLevel l) {
  static const char* names[] = {"debug", "info", "WARN", "ERROR"};
  return names[int(l)];
}
const char* json_name(LogLevel l) {
  static const char* names[] = {"debug", "info", "warn", "error"};
  return names[int(l)];
}

}  // namespace

LogFormat parse_log_format(const std::string& name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  throw InputError("log format '" + name + "': use text or json");
}

void set_log_format(LogFormat f) { g_format = f; }
void set_log_job(uint64_t job) { g_job = job; }
void set_log_peer(const std::string& peer) {
  std::lock_guard<std::mutex> l(g_peer_mu);
  g_peer = peer;
}

std::string format_log_line(LogFormat f, double wall_s, LogLevel level, const std::string& component, const std::string& message,
                            const LogFields& fields) {
  // Whole milliseconds; the microsecond added absorbs the double's rounding (x.123 read as x.12299...).
  const int64_t total_ms = int64_t(std::floor(wall_s * 1000 + 1e-3));
  const time_t secs = time_t(total_ms / 1000);
  const int ms = int(total_ms % 1000);
  tm t;
  char buf[64];
  if (f == LogFormat::kText) {
    localtime_r(&secs, &t);
    std::snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03d", t.tm_hour, t.tm_min, t.tm_sec, ms);
    return std::string(buf) + " " + text_name(level) + " " + component + ": " + message;
  }
  gmtime_r(&secs, &t);
  std::snprintf(buf, sizeof(buf), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", t.tm_year + 1900, t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min,
                t.tm_sec, ms);
  const uint64_t job = fields.job ? fields.job : g_job.load();
  std::string peer = fields.peer;
  if (peer.empty()) {
    std::lock_guard<std::mutex> l(g_peer_mu);
    peer = g_peer;
  }
  // Keys in this order (nlohmann's ordered_json), so a line reads the same as the text form.
  nlohmann::ordered_json j;
  j["time"] = buf;
  j["level"] = json_name(level);
  j["component"] = component;
  j["job"] = job ? nlohmann::ordered_json(job) : nlohmann::ordered_json(nullptr);
  j["peer"] = peer.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(peer);
  j["message"] = message;
  // A message that is not valid UTF-8 (bytes from the network quoted in an error) is written
  // with U+FFFD in place of the bad bytes rather than lost.
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

void log_line(LogLevel level, const std::string& component, const std::string& message, const LogFields& fields) {
  if (level < threshold()) return;
  timeval tv;
  gettimeofday(&tv, nullptr);
  std::string line = format_log_line(g_format, double(tv.tv_sec) + tv.tv_usec / 1e6, level, component, message, fields) + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace swarm
