// chaos_plan.cpp: the chaos plan's parser and its seeded timing and choices (see chaos_plan.h).
#include "runtime/chaos_plan.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include "runtime/errors.h"
#include "runtime/random.h"
#include "runtime/text.h"

namespace swarm {

using nlohmann::json;

namespace {

[[noreturn]] void fail(const std::string& where, const std::string& msg) {
  throw InputError("chaos plan: " + where + ": " + msg);
}

double seconds_of(const std::string& where, const std::string& key, const json& v, double min) {
  if (!v.is_number() || !std::isfinite(v.get<double>()))
    fail(where, key + " must be a number of seconds, got " + shown_json(v));
  const double d = v.get<double>();
  if (d < min) fail(where, key + "=" + shown_json(v) + ": give a value >= " + std::to_string(int(min)));
  return d;
}

ChaosAction action_of(const std::string& where, const json& v) {
  const std::vector<std::string> names = {"kill", "stop", "cont", "restart"};
  if (!v.is_string()) fail(where, "\"action\" must be one of: " + join(names));
  const std::string s = v.get<std::string>();
  for (size_t i = 0; i < names.size(); ++i)
    if (s == names[i]) return ChaosAction(i);
  fail(where, "unknown action \"" + s + "\"" + suggestion(s, names) + "; the actions are: " + join(names));
}

// Which keys each kind of event takes: the timing keys, then the action's own.
std::vector<std::string> keys_for(ChaosAction a, bool periodic) {
  std::vector<std::string> k = {"action", "peer", "comment"};
  if (periodic) k.insert(k.end(), {"every_s", "start_s", "count", "jitter_s"});
  else k.insert(k.end(), {"at_s", "jitter_s"});
  if (a == ChaosAction::kStop) k.push_back("duration_s");
  if (a == ChaosAction::kKill) k.push_back("restart_after_s");
  return k;
}

ChaosEvent parse_event(const json& j, size_t i) {
  const std::string where = "events[" + std::to_string(i) + "]";
  if (!j.is_object()) fail(where, "give an object {\"at_s\" or \"every_s\", \"action\", \"peer\", ...}");
  ChaosEvent e;
  auto a = j.find("action");
  if (a == j.end()) fail(where, "\"action\" is missing; one of: kill, stop, cont, restart");
  e.action = action_of(where, *a);
  const bool has_at = j.contains("at_s"), has_every = j.contains("every_s");
  if (has_at == has_every) fail(where, "give exactly one of \"at_s\" (once) or \"every_s\" (periodic)");
  const std::vector<std::string> keys = keys_for(e.action, has_every);
  for (const auto& item : j.items()) {
    const std::string& k = item.key();
    const json& v = item.value();
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) {
      std::string hint;
      if (k == "duration_s" && e.action == ChaosAction::kKill) hint = " (a kill's down time is restart_after_s)";
      if (k == "restart_after_s" && e.action == ChaosAction::kStop) hint = " (a stop's length is duration_s)";
      if (hint.empty()) {
        const std::string best = did_you_mean(k, keys);
        if (!best.empty()) hint = " (did you mean \"" + best + "\"?)";
      }
      fail(where, "key \"" + k + "\" does not apply to a " + std::string(has_every ? "periodic " : "") +
                      chaos_action_name(e.action) + " event" + hint + "; it takes: " + join(keys));
    }
    if (k == "action" || k == "comment") continue;
    if (k == "peer") {
      if (!v.is_string() || v.get<std::string>().empty()) fail(where, "\"peer\" must be a peer name (\"stage1-0\") or \"random\"");
      e.peer = v.get<std::string>();
    } else if (k == "count") {
      if (!v.is_number_unsigned()) fail(where, "count must be a whole number >= 0, got " + shown_json(v));
      e.count = v.get<uint64_t>();
    } else if (k == "every_s") {
      e.every_s = seconds_of(where, k, v, 0);
      if (e.every_s <= 0) fail(where, "every_s must be > 0");
    } else {
      const double d = seconds_of(where, k, v, 0);
      if (k == "at_s") e.at_s = d;
      else if (k == "start_s") e.start_s = d;
      else if (k == "jitter_s") e.jitter_s = d;
      else if (k == "duration_s") e.duration_s = d;
      else e.restart_after_s = d;
    }
  }
  return e;
}

}  // namespace

const char* chaos_action_name(ChaosAction a) {
  switch (a) {
    case ChaosAction::kKill: return "kill";
    case ChaosAction::kStop: return "stop";
    case ChaosAction::kCont: return "cont";
    case ChaosAction::kRestart: return "restart";
  }
  return "?";
}

std::vector<std::string> ChaosPlan::stage_args(const std::string& peer) const {
  auto it = faults.find(peer);
  if (it == faults.end() || it->second.empty()) return {};
  std::vector<std::string> args;
  for (const FaultSpec& f : it->second) {
    args.push_back("--fault");
    args.push_back(to_string(f));
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a of the name: each peer draws its own sequence
  for (char c : peer) h = (h ^ uint8_t(c)) * 1099511628211ull;
  args.push_back("--fault-seed");
  args.push_back(std::to_string(splitmix64(seed ^ h) >> 1));
  return args;
}

ChaosPlan parse_chaos_plan(const json& j) {
  if (!j.is_object()) fail("(top level)", "give an object {\"seed\": N, \"events\": [...], \"faults\": {...}}");
  ChaosPlan plan;
  for (const auto& item : j.items()) {
    const std::string& k = item.key();
    const json& v = item.value();
    if (k == "seed") {
      if (!v.is_number_unsigned()) fail("seed", "must be a whole number >= 0, got " + shown_json(v));
      plan.seed = v.get<uint64_t>();
    } else if (k == "events") {
      if (!v.is_array()) fail("events", "must be a list of events");
      for (size_t i = 0; i < v.size(); ++i) plan.events.push_back(parse_event(v[i], i));
    } else if (k == "faults") {
      if (!v.is_object()) fail("faults", "must map peer names to lists of faults: {\"stage1-0\": [\"slow,factor=4\"]}");
      for (const auto& pf : v.items()) {
        if (!pf.value().is_array()) fail("faults." + pf.key(), "must be a list of faults, e.g. [\"slow,factor=4\"]");
        for (const auto& f : pf.value()) {
          try {
            plan.faults[pf.key()].push_back(parse_fault_json(f));
          } catch (const InputError& e) {
            fail("faults." + pf.key(), e.what());
          }
        }
      }
    } else if (k != "comment") {
      fail(k, "unknown key" + suggestion(k, {"seed", "events", "faults", "comment"}) + "; the keys are: seed, events, faults, comment");
    }
  }
  return plan;
}

ChaosPlan load_chaos_plan(const std::string& path) {
  const json j = read_json_file("chaos plan", path);
  try {
    return parse_chaos_plan(j);
  } catch (const InputError& e) {
    throw InputError(path + ": " + e.what());
  }
}

double chaos_fire_time(const ChaosPlan& plan, size_t index, uint64_t k) {
  const ChaosEvent& e = plan.events.at(index);
  double t = e.periodic() ? (e.start_s >= 0 ? e.start_s : e.every_s) + double(k) * e.every_s : e.at_s;
  if (e.jitter_s > 0) t += e.jitter_s * double(counter_draw(plan.seed, index, k, 1) >> 11) * (1.0 / 9007199254740992.0);
  return t;
}

size_t chaos_pick(uint64_t seed, size_t index, uint64_t k, size_t n) {
  return n ? size_t(counter_draw(seed, index, k, 2) % n) : 0;
}

}  // namespace swarm
