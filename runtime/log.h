// log.h: one line per event on stderr, as text for people or JSON for log collectors.
//
// Defines LogLevel, LogFormat, LogFields, `log_line` and its shorthands, and the process-wide
// settings: `set_log_format` (every binary's --log-format text|json), `set_log_peer` and
// `set_log_job` (the peer and job a line is about when the call does not say).
//   text: "HH:MM:SS.mmm LEVEL component: message" (local time)
//   json: {"time":"2024-05-01T12:00:00.123Z","level":"info","component":"router","job":3,
//          "peer":"stage1-0","message":"..."}   (UTC; job and peer null when none)
// SWARM_LOG=debug|info|warn|error sets the least level shown (default info). Thread-safe:
// each line is written with one call.
#pragma once

#include <cstdint>
#include <string>

namespace swarm {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };
enum class LogFormat { kText, kJson };

// What a line is about, beyond its component. job 0 and peer "" fall back to the process's own
// (set_log_job, set_log_peer), and are null in JSON when that is unset too.
struct LogFields {
  uint64_t job = 0;
  std::string peer;
};

void log_line(LogLevel level, const std::string& component, const std::string& message, const LogFields& fields = {});
inline void log_debug(const std::string& c, const std::string& m) { log_line(LogLevel::kDebug, c, m); }
inline void log_info(const std::string& c, const std::string& m) { log_line(LogLevel::kInfo, c, m); }
inline void log_warn(const std::string& c, const std::string& m) { log_line(LogLevel::kWarn, c, m); }
inline void log_error(const std::string& c, const std::string& m) { log_line(LogLevel::kError, c, m); }

// "text" or "json"; throws InputError naming the choices for anything else.
LogFormat parse_log_format(const std::string& name);
void set_log_format(LogFormat f);
// The peer (a stage server's name) and job every line of this process is about by default.
void set_log_peer(const std::string& peer);
void set_log_job(uint64_t job);

// The line `log_line` would write, without its newline (tests; `wall_s`: seconds since the epoch).
std::string format_log_line(LogFormat f, double wall_s, LogLevel level, const std::string& component, const std::string& message,
                            const LogFields& fields);

}  // namespace swarm
