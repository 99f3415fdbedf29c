// text.cpp: see text.h.
#include "runtime/text.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "runtime/errors.h"

namespace swarm {

std::string shortest_number(double v) {
  std::string out;
  for (int prec = 6; prec <= 17; ++prec) {
    std::ostringstream t;
    t.precision(prec);
    t << v;
    out = t.str();
    if (std::strtod(out.c_str(), nullptr) == v) break;
  }
  return out;
}

std::string join(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ", " : "") + items[i];
  return s;
}

std::string clip(const std::string& s, size_t max_chars) {
  if (s.size() <= max_chars) return s;
  size_t cut = max_chars > 3 ? max_chars - 3 : 0;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xc0) == 0x80) --cut;  // 10xxxxxx: inside a character
  return s.substr(0, cut) + "...";
}

namespace {

// dump() recurses once per level, and a 1 MiB spec can nest 500,000 deep: below the second
// level a container shows as [...] or {...}, and the walk stops once the text is long enough.
// Values from msgpack (SUBMIT, LOAD_STAGE) may hold strings that are not UTF-8, which dump()
// would throw on: such bytes show as U+FFFD.
void preview(const nlohmann::json& v, int depth, size_t max_chars, std::string& out) {
  using nlohmann::json;
  if (out.size() > max_chars) return;
  if (!v.is_array() && !v.is_object()) {
    out += v.dump(-1, ' ', false, json::error_handler_t::replace);
    return;
  }
  const bool array = v.is_array();
  if (depth >= 2 && !v.empty()) {
    out += array ? "[...]" : "{...}";
    return;
  }
  out += array ? '[' : '{';
  bool first = true;
  for (auto it = v.begin(); it != v.end() && out.size() <= max_chars; ++it) {
    if (!first) out += ',';
    first = false;
    if (!array) out += json(it.key()).dump(-1, ' ', false, json::error_handler_t::replace) + ':';
    preview(*it, depth + 1, max_chars, out);
  }
  out += array ? ']' : '}';
}

// Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
// adjacent characters each count one.
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

}  // namespace

std::string shown_json(const nlohmann::json& v, size_t max_chars) {
  std::string out;
  preview(v, 0, max_chars, out);
  return clip(out, max_chars);
}

std::string did_you_mean(const std::string& key, const std::vector<std::string>& allowed) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& a : allowed) {
    // The table costs key.size() x a.size(): a key far longer than every allowed one (a spec
    // text may hold a 1 MiB key) is no typo of any, and is not measured.
    if (key.size() > a.size() + 24) continue;
    const size_t d = edit_distance(key, a);
    if (d < best_d) best_d = d, best = a;
  }
  if (best.empty() || best_d > std::max<size_t>(1, std::min(key.size(), best.size()) / 3)) return "";
  return best;
}

std::string suggestion(const std::string& key, const std::vector<std::string>& allowed) {
  const std::string best = did_you_mean(key, allowed);
  return best.empty() ? "" : ": did you mean \"" + best + "\"?";
}

nlohmann::json read_json_file(const std::string& what, const std::string& path) {
  std::ifstream f(path);
  if (!f) throw InputError(what + " " + path + ": cannot read the file (" + std::strerror(errno) + ")");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(what + " " + path + ": not valid JSON: " + e.what());
  }
}

}  // namespace swarm
