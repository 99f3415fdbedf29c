// log.cpp: the stderr logger (see log.h).
#include "runtime/log.h"

#include <sys/time.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

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
}  // namespace

void log_line(LogLevel level, const std::string& component, const std::string& message) {
  if (level < threshold()) return;
  static const char* names[] = {"debug", "info", "WARN", "ERROR"};
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm t;
  localtime_r(&tv.tv_sec, &t);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03d", t.tm_hour, t.tm_min, t.tm_sec, int(tv.tv_usec / 1000));
  std::string line = std::string(buf) + " " + names[int(level)] + " " + component + ": " + message + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace swarm
