// text.cpp: see text.h.
#include "runtime/text.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
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

std::string shown_json(const nlohmann::json& v, size_t max_chars) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > max_chars) s = s.substr(0, max_chars > 3 ? max_chars - 3 : 0) + "...";
  return s;
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
