// fault.cpp: fault specs, their text and JSON forms, the injector's decisions, and the frame
// helpers (see fault.h).
//
// Every random decision is a pure function of (seed, spec index, eligible-opportunity counter)
// through splitmix64, so a run with the same seed and the same sequence of opportunities fires
// the same faults at the same places, whatever the threads' timing between opportunities.
#include "runtime/fault.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <msgpack.hpp>

#include "runtime/errors.h"
#include "runtime/random.h"
#include "runtime/text.h"
#include "runtime/limits.h"
#include "runtime/log.h"
#include "runtime/wire.h"

namespace swarm {

using nlohmann::json;

namespace {

constexpr FaultAction kActions[] = {FaultAction::kCrash, FaultAction::kFreeze,    FaultAction::kZombie,
                                    FaultAction::kSlow,  FaultAction::kDrop,      FaultAction::kDelay,
                                    FaultAction::kDuplicate, FaultAction::kCorrupt, FaultAction::kPartition,
                                    FaultAction::kNan, FaultAction::kOverflow, FaultAction::kLie};
constexpr FaultPoint kPoints[] = {FaultPoint::kBeforeSend, FaultPoint::kAfterRecv, FaultPoint::kBeforeCompute,
                                  FaultPoint::kAfterCompute, FaultPoint::kHeartbeat};
constexpr double kInf = std::numeric_limits<double>::infinity();

std::string num(double v) { return shortest_number(v); }

std::vector<std::string> action_names() {
  std::vector<std::string> v;
  for (FaultAction a : kActions) v.push_back(fault_action_name(a));
  return v;
}
std::string all_actions() { return join(action_names()); }

// The keys an action takes, in canonical order.
std::vector<std::string> keys_of(FaultAction a) {
  std::vector<std::string> k = {"point", "on", "after", "step", "after_s", "p", "count"};
  if (a == FaultAction::kFreeze || a == FaultAction::kZombie || a == FaultAction::kPartition) k.push_back("duration_s");
  if (a == FaultAction::kSlow) k.push_back("factor");
  if (a == FaultAction::kDelay) k.push_back("delay_ms");
  return k;
}

std::vector<FaultPoint> points_of(FaultAction a) {
  switch (a) {
    case FaultAction::kSlow:
    case FaultAction::kNan: return {FaultPoint::kBeforeCompute, FaultPoint::kAfterCompute};
    case FaultAction::kOverflow: return {FaultPoint::kBeforeCompute};  // decided before the backward runs
    case FaultAction::kLie: return {FaultPoint::kAfterCompute};         // the reply exists then
    case FaultAction::kDrop:
    case FaultAction::kDelay:
    case FaultAction::kDuplicate:
    case FaultAction::kCorrupt: return {FaultPoint::kBeforeSend, FaultPoint::kAfterRecv, FaultPoint::kHeartbeat};
    default: return {std::begin(kPoints), std::end(kPoints)};
  }
}

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Where a spec is being read, for messages: `fault "slow,factr=3"`.
struct Where {
  std::string what;
  [[noreturn]] void fail(const std::string& msg) const { throw InputError(what + ": " + msg); }
};

std::optional<FaultAction> action_named(const std::string& s) {
  for (FaultAction a : kActions)
    if (s == fault_action_name(a)) return a;
  return std::nullopt;
}

std::optional<FaultPoint> point_named(const std::string& s) {
  for (FaultPoint p : kPoints)
    if (s == fault_point_name(p)) return p;
  return std::nullopt;
}

FaultAction parse_action(const Where& w, const std::string& name) {
  if (name.empty()) w.fail("no action; give ACTION[,key=value...], e.g. crash,after=20; actions: " + all_actions());
  auto a = action_named(name);
  if (!a) w.fail("unknown action \"" + name + "\"" + suggestion(name, action_names()) + "; the actions are: " + all_actions());
  return *a;
}

double number_of(const Where& w, const std::string& key, const json& v) {
  if (!v.is_number()) w.fail(key + " must be a number, got " + shown_json(v));
  const double d = v.get<double>();
  if (!std::isfinite(d)) w.fail(key + " must be finite");
  return d;
}

uint64_t whole_of(const Where& w, const std::string& key, const json& v) {
  const double d = number_of(w, key, v);
  if (d < 0 || d != std::floor(d) || d > 9007199254740992.0)
    w.fail(key + "=" + shown_json(v) + ": give a whole number >= 0");
  return uint64_t(d);
}

// Sets one key of `s` (whose action is already set); `v` is a JSON number or, for point, a string.
void set_key(FaultSpec& s, const Where& w, const std::string& key, const json& v) {
  const std::vector<std::string> keys = keys_of(s.action);
  const std::string action = fault_action_name(s.action);
  if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
    static const std::vector<std::string> all = {"point", "on", "after", "step", "after_s", "p", "count",
                                                 "duration_s", "factor", "delay_ms"};
    std::string msg = std::find(all.begin(), all.end(), key) == all.end() ? "unknown key \"" + key + "\"" + suggestion(key, keys)
                                                                          : "key \"" + key + "\" does not apply to " + action;
    w.fail(msg + "; " + action + " takes: " + join(keys));
  }
  if (key == "point") {
    std::vector<std::string> names;
    for (FaultPoint p : points_of(s.action)) names.push_back(fault_point_name(p));
    auto p = v.is_string() ? point_named(v.get<std::string>()) : std::nullopt;
    if (!p || std::find(names.begin(), names.end(), fault_point_name(*p)) == names.end())
      w.fail("point=" + (v.is_string() ? v.get<std::string>() : shown_json(v)) + " is not a point for " + action + "; " +
             action + " takes point=" + join(names));
    s.point = *p;
  } else if (key == "on") {
    const std::string name = v.is_string() ? v.get<std::string>() : shown_json(v);
    s.on = 0;
    for (int t = 1; t <= 1000 && !s.on; ++t)
      if (wire::known_type(t) && name == lower(wire::msg_type_name(static_cast<wire::MsgType>(t)))) s.on = t;
    if (!s.on) w.fail("on=" + name + " is not a message type; give one in lower case, e.g. on=forward, on=round_begin, on=step");
  } else if (key == "after") {
    s.after = whole_of(w, key, v);
  } else if (key == "step") {
    s.step = whole_of(w, key, v);
  } else if (key == "count") {
    s.count = whole_of(w, key, v);
  } else if (key == "p") {
    s.p = number_of(w, key, v);
    if (s.p < 0 || s.p > 1) w.fail("p=" + num(s.p) + ": a probability is between 0 and 1");
  } else if (key == "factor") {
    s.factor = number_of(w, key, v);
    if (s.factor < 1 || s.factor > 1000) w.fail("factor=" + num(s.factor) + ": give a slowdown between 1 and 1000");
  } else {  // after_s, duration_s, delay_ms
    const double d = number_of(w, key, v);
    if (d < 0) w.fail(key + "=" + num(d) + ": give a value >= 0");
    (key == "after_s" ? s.after_s : key == "duration_s" ? s.duration_s : s.delay_ms) = d;
  }
}

// A text value as JSON: point stays a string, every other key must be a number.
json text_value(const Where& w, const std::string& key, const std::string& text) {
  if (key == "point" || key == "on") return text;
  char* end = nullptr;
  const double d = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size())
    w.fail(key + "=" + text + ": not a number");
  return d;
}

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

double unit(uint64_t r) { return double(r >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)

bool is_hop(int t) {
  using wire::MsgType;
  return t == int(MsgType::kForward) || t == int(MsgType::kForwardLoss) || t == int(MsgType::kBackward) ||
         t == int(MsgType::kEval);
}

std::string seconds(double s) { return std::isinf(s) ? "until the process ends" : "for " + num(s) + " s"; }

}  // namespace

const char* fault_point_name(FaultPoint p) {
  switch (p) {
    case FaultPoint::kBeforeSend: return "before_send";
    case FaultPoint::kAfterRecv: return "after_recv";
    case FaultPoint::kBeforeCompute: return "before_compute";
    case FaultPoint::kAfterCompute: return "after_compute";
    case FaultPoint::kHeartbeat: return "heartbeat";
  }
  return "?";
}

const char* fault_action_name(FaultAction a) {
  switch (a) {
    case FaultAction::kCrash: return "crash";
    case FaultAction::kFreeze: return "freeze";
    case FaultAction::kZombie: return "zombie";
    case FaultAction::kSlow: return "slow";
    case FaultAction::kDrop: return "drop";
    case FaultAction::kDelay: return "delay";
    case FaultAction::kDuplicate: return "duplicate";
    case FaultAction::kCorrupt: return "corrupt";
    case FaultAction::kPartition: return "partition";
    case FaultAction::kNan: return "nan";
    case FaultAction::kOverflow: return "overflow";
    case FaultAction::kLie: return "lie";
  }
  return "?";
}

FaultPoint default_point(FaultAction a) {
  switch (a) {
    case FaultAction::kCrash:
    case FaultAction::kOverflow: return FaultPoint::kBeforeCompute;
    case FaultAction::kLie: return FaultPoint::kAfterCompute;
    case FaultAction::kSlow:
    case FaultAction::kNan: return FaultPoint::kAfterCompute;
    case FaultAction::kDrop:
    case FaultAction::kDelay:
    case FaultAction::kDuplicate:
    case FaultAction::kCorrupt: return FaultPoint::kBeforeSend;
    case FaultAction::kFreeze:
    case FaultAction::kZombie:
    case FaultAction::kPartition: return FaultPoint::kAfterRecv;
  }
  return FaultPoint::kBeforeCompute;
}

uint64_t default_count(FaultAction a) {
  switch (a) {
    case FaultAction::kCrash:
    case FaultAction::kFreeze:
    case FaultAction::kZombie:
    case FaultAction::kPartition:
    case FaultAction::kOverflow: return 1;
    default: return 0;
  }
}

FaultSpec FaultSpec::defaults(FaultAction action) {
  FaultSpec s;
  s.action = action;
  s.point = default_point(action);
  s.count = default_count(action);
  return s;
}

bool FaultSpec::operator==(const FaultSpec& o) const {
  return action == o.action && point == o.point && on == o.on && after == o.after && step == o.step && after_s == o.after_s &&
         p == o.p && count == o.count && duration_s == o.duration_s && factor == o.factor && delay_ms == o.delay_ms;
}

FaultSpec parse_fault(const std::string& text) {
  const Where w{"fault \"" + (text.size() <= 120 ? text : text.substr(0, 117) + "...") + "\""};
  std::vector<std::string> parts;
  std::stringstream ss(text);
  for (std::string part; std::getline(ss, part, ',');) parts.push_back(trim(part));
  if (parts.empty()) parts.push_back("");
  FaultSpec s = FaultSpec::defaults(parse_action(w, parts[0]));
  std::vector<std::string> seen;
  for (size_t i = 1; i < parts.size(); ++i) {
    const size_t eq = parts[i].find('=');
    if (eq == std::string::npos || eq == 0)
      w.fail("\"" + parts[i] + "\" is not key=value; " + parts[0] + " takes: " + join(keys_of(s.action)));
    const std::string key = trim(parts[i].substr(0, eq)), value = trim(parts[i].substr(eq + 1));
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) w.fail("key \"" + key + "\" given twice");
    seen.push_back(key);
    set_key(s, w, key, text_value(w, key, value));
  }
  return s;
}

FaultSpec parse_fault_json(const json& j) {
  if (j.is_string()) return parse_fault(j.get<std::string>());
  const std::string shown = shown_json(j, 120);
  const Where w{"fault " + shown};
  if (!j.is_object()) w.fail("give an object {\"action\": ..., key: value...} or a string \"ACTION[,key=value...]\"");
  auto a = j.find("action");
  if (a == j.end() || !a->is_string()) w.fail("\"action\" (a string) is missing; the actions are: " + all_actions());
  FaultSpec s = FaultSpec::defaults(parse_action(w, a->get<std::string>()));
  for (const auto& item : j.items()) {
    if (item.key() == "action") continue;
    set_key(s, w, item.key(), item.value());
  }
  return s;
}

std::string to_string(const FaultSpec& s) {
  std::string out = fault_action_name(s.action);
  auto add = [&](const std::string& k, const std::string& v) { out += "," + k + "=" + v; };
  if (s.point != default_point(s.action)) add("point", fault_point_name(s.point));
  if (s.on) add("on", lower(wire::msg_type_name(static_cast<wire::MsgType>(s.on))));
  if (s.after) add("after", std::to_string(s.after));
  if (s.step) add("step", std::to_string(s.step));
  if (s.after_s != 0) add("after_s", num(s.after_s));
  if (s.p != 1) add("p", num(s.p));
  if (s.count != default_count(s.action)) add("count", std::to_string(s.count));
  const auto keys = keys_of(s.action);
  if (std::find(keys.begin(), keys.end(), "duration_s") != keys.end() && s.duration_s != 0) add("duration_s", num(s.duration_s));
  if (s.action == FaultAction::kSlow) add("factor", num(s.factor));
  if (s.action == FaultAction::kDelay) add("delay_ms", num(s.delay_ms));
  return out;
}

json to_json(const FaultSpec& s) {
  json j{{"action", fault_action_name(s.action)}, {"point", fault_point_name(s.point)}, {"after", s.after},
         {"step", s.step}, {"after_s", s.after_s}, {"p", s.p}, {"count", s.count}};
  if (s.on) j["on"] = lower(wire::msg_type_name(static_cast<wire::MsgType>(s.on)));
  if (s.action == FaultAction::kFreeze || s.action == FaultAction::kZombie || s.action == FaultAction::kPartition)
    j["duration_s"] = s.duration_s;
  if (s.action == FaultAction::kSlow) j["factor"] = s.factor;
  if (s.action == FaultAction::kDelay) j["delay_ms"] = s.delay_ms;
  return j;
}

FaultPlan parse_fault_plan(const json& j) {
  if (!j.is_object()) throw InputError("fault plan: give an object {\"seed\": N, \"faults\": [...]}");
  FaultPlan plan;
  for (const auto& item : j.items()) {
    if (item.key() == "seed") {
      if (!item.value().is_number_unsigned()) throw InputError("fault plan: seed must be a whole number >= 0, got " + shown_json(item.value()));
      plan.seed = item.value().get<uint64_t>();
    } else if (item.key() == "faults") {
      if (!item.value().is_array()) throw InputError("fault plan: faults must be a list of faults");
      for (const auto& f : item.value()) plan.faults.push_back(parse_fault_json(f));
    } else {
      throw InputError("fault plan: unknown key \"" + item.key() + "\"" + suggestion(item.key(), {"seed", "faults"}) + "; the keys are: seed, faults");
    }
  }
  return plan;
}

FaultPlan load_fault_plan(const std::string& path) {
  const json j = read_json_file("fault plan", path);
  try {
    return parse_fault_plan(j);
  } catch (const InputError& e) {
    throw InputError(path + ": " + e.what());
  }
}

// ---- the injector ----------------------------------------------------------------------------

FaultInjector::FaultInjector(uint64_t seed, ClockFn clock) : seed_(seed), clock_(std::move(clock)) {
  if (!clock_) {
    clock_ = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  }
}

size_t FaultInjector::add(const FaultSpec& spec, uint64_t requests_now) {
  std::lock_guard<std::mutex> l(mu_);
  Armed a;
  a.spec = spec;
  a.text = to_string(spec);
  a.armed_at = clock_();
  a.requests_at = requests_now;
  faults_.push_back(std::move(a));
  armed_ = true;
  return faults_.size() - 1;
}

std::vector<FaultSpec> FaultInjector::specs() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<FaultSpec> v;
  for (const auto& a : faults_) v.push_back(a.spec);
  return v;
}

uint64_t FaultInjector::fired(size_t index) const {
  std::lock_guard<std::mutex> l(mu_);
  return index < faults_.size() ? faults_[index].fired : 0;
}

// Heartbeats are opportunities only at the heartbeat point; slow and nan only on hops
// (FORWARD, FORWARD_LOSS, BACKWARD, EVAL), nan only when the reply carries an output, overflow
// only on FORWARD_LOSS and BACKWARD.
bool FaultInjector::applies(const Armed& a, FaultPoint point, const FaultContext& ctx) const {
  const bool heartbeat = ctx.msg_type == int(wire::MsgType::kHeartbeat);
  if ((point == FaultPoint::kHeartbeat) != heartbeat && ctx.msg_type != 0) return false;
  if (a.spec.action == FaultAction::kSlow || a.spec.action == FaultAction::kNan) {
    if (ctx.msg_type != 0 && !is_hop(ctx.msg_type)) return false;
    if (a.spec.action == FaultAction::kNan && !ctx.has_output) return false;
  }
  if (a.spec.action == FaultAction::kOverflow && ctx.msg_type != 0 && ctx.msg_type != int(wire::MsgType::kForwardLoss) &&
      ctx.msg_type != int(wire::MsgType::kBackward))
    return false;  // only a backward can overflow
  return true;
}

bool FaultInjector::eligible(const Armed& a, const FaultContext& ctx, double now) const {
  const FaultSpec& s = a.spec;
  if (s.on && ctx.msg_type != s.on) return false;
  if (s.after && ctx.requests < a.requests_at + s.after) return false;
  if (s.step && ctx.step < s.step) return false;
  if (s.after_s > 0 && now - a.armed_at < s.after_s) return false;
  return true;
}

void FaultInjector::start_state(const FaultSpec& s, double now) {
  const double until = s.duration_s > 0 ? now + s.duration_s : kInf;
  if (s.action == FaultAction::kFreeze) frozen_until_ = std::max(frozen_until_, until);
  if (s.action == FaultAction::kPartition) partitioned_until_ = std::max(partitioned_until_, until);
  if (s.action == FaultAction::kZombie) zombie_until_ = std::max(zombie_until_, until);
}

std::vector<FaultHit> FaultInjector::check(FaultPoint point, const FaultContext& ctx) {
  std::vector<FaultHit> hits;
  if (!armed_) return hits;
  std::lock_guard<std::mutex> l(mu_);
  const double now = clock_();
  for (size_t i = 0; i < faults_.size(); ++i) {
    Armed& a = faults_[i];
    if (a.spec.point != point || (a.spec.count && a.fired >= a.spec.count)) continue;
    if (!applies(a, point, ctx) || !eligible(a, ctx, now)) continue;
    const uint64_t k = a.opportunities++;
    if (a.spec.p < 1 && !(unit(counter_draw(seed_, i, k, 0)) < a.spec.p)) continue;
    a.fired++;
    FaultHit h;
    h.action = a.spec.action;
    h.index = i;
    h.spec = a.text;
    h.duration_s = a.spec.duration_s;
    h.factor = a.spec.factor;
    h.delay_ms = a.spec.delay_ms;
    h.random = counter_draw(seed_, i, k, 1);
    start_state(a.spec, now);
    std::string where = std::string(" at ") + fault_point_name(point);
    if (ctx.msg_type) where += std::string(" (") + wire::msg_type_name(wire::MsgType(ctx.msg_type)) + ",";
    else where += " (";
    where += " request " + std::to_string(ctx.requests) + ", step " + std::to_string(ctx.step) + ")";
    std::string state;
    if (h.action == FaultAction::kFreeze || h.action == FaultAction::kPartition || h.action == FaultAction::kZombie)
      state = "; " + std::string(h.action == FaultAction::kFreeze ? "frozen " : h.action == FaultAction::kZombie ? "zombie " : "partitioned ") +
              seconds(h.duration_s > 0 ? h.duration_s : kInf);
    log_warn("fault", "fault fired: " + a.text + where + state +
                          (a.spec.count ? " [" + std::to_string(a.fired) + "/" + std::to_string(a.spec.count) + "]" : ""));
    hits.push_back(std::move(h));
  }
  return hits;
}

bool FaultInjector::frozen() const { return armed_ && now() < frozen_until(); }
bool FaultInjector::partitioned() const { return armed_ && now() < partitioned_until(); }
bool FaultInjector::zombie() const {
  if (!armed_) return false;
  std::lock_guard<std::mutex> l(mu_);
  return clock_() < zombie_until_;
}
double FaultInjector::frozen_until() const {
  std::lock_guard<std::mutex> l(mu_);
  return frozen_until_;
}
double FaultInjector::partitioned_until() const {
  std::lock_guard<std::mutex> l(mu_);
  return partitioned_until_;
}
double FaultInjector::now() const { return clock_(); }

// ---- raw frames ------------------------------------------------------------------------------

std::optional<int> peek_type(const std::vector<zmq::message_t>& frames) {
  if (frames.empty() || frames[0].size() > limits::kMaxEnvelopeBytes) return std::nullopt;
  try {
    msgpack::object_handle oh = msgpack::unpack(static_cast<const char*>(frames[0].data()), frames[0].size());
    const msgpack::object& o = oh.get();
    if (o.type != msgpack::type::ARRAY || o.via.array.size != 5) return std::nullopt;
    const msgpack::object& t = o.via.array.ptr[2];
    if (t.type != msgpack::type::POSITIVE_INTEGER || t.via.u64 > 1000) return std::nullopt;
    return int(t.via.u64);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

void corrupt_frames(std::vector<zmq::message_t>& frames, uint64_t random) {
  std::vector<size_t> tensors;
  for (size_t i = 2; i < frames.size(); ++i)
    if (frames[i].size() > 0) tensors.push_back(i);
  if (tensors.empty() && frames.size() < 2) return;
  const size_t fi = tensors.empty() ? 1 : tensors[random % tensors.size()];
  zmq::message_t copy(frames[fi].data(), frames[fi].size());
  if (copy.size() == 0) return;
  auto* bytes = static_cast<uint8_t*>(copy.data());
  if (tensors.empty()) {
    bytes[0] ^= 0xFF;  // a msgpack map header (0x8N, 0xDE, 0xDF) becomes an integer or a byte string
  } else {
    const uint8_t mask = uint8_t(1 + (random >> 8) % 255);  // never 0: the byte always changes
    bytes[(random >> 16) % copy.size()] ^= mask;
  }
  frames[fi] = std::move(copy);
}

}  // namespace swarm
