// log.h: one-line logs to stderr: "HH:MM:SS.mmm LEVEL component: message".
//
// SWARM_LOG=debug|info|warn|error sets the least level shown (default info). Thread-safe:
// each line is written with one call.
#pragma once

#include <string>

namespace swarm {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };
void log_line(LogLevel level, const std::string& component, const std::string& message);
inline void log_debug(const std::string& c, const std::string& m) { log_line(LogLevel::kDebug, c, m); }
inline void log_info(const std::string& c, const std::string& m) { log_line(LogLevel::kInfo, c, m); }
inline void log_warn(const std::string& c, const std::string& m) { log_line(LogLevel::kWarn, c, m); }
inline void log_error(const std::string& c, const std::string& m) { log_line(LogLevel::kError, c, m); }

}  // namespace swarm
