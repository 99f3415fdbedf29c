// scenario.cpp: implements sim/scenario.h.
#include "sim/scenario.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "runtime/limits.h"
#include "runtime/text.h"

namespace swarm::sim {

namespace {

using nlohmann::json;

// One JSON object's fields, read once each; whatever is left over is a mistake worth naming.
class Fields {
 public:
  Fields(const json& j, std::string where) : j_(j), where_(std::move(where)) {
    if (!j.is_object()) fail("must be an object");
  }
  [[noreturn]] void fail(const std::string& what) const { throw ScenarioError(where_ + ": " + what); }
  bool has(const char* k) {
    seen_.insert(k);
    return j_.contains(k) && !j_[k].is_null();
  }
  const json& at(const char* k) {
    seen_.insert(k);
    return j_.at(k);
  }
  double number(const char* k, double def, double lo, double hi) {
    if (!has(k)) return def;
    const json& v = j_[k];
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < lo || v.get<double>() > hi)
      fail(std::string(k) + " must be a number in [" + num(lo) + ", " + num(hi) + "], got " + v.dump());
    return v.get<double>();
  }
  int64_t integer(const char* k, int64_t def, int64_t lo, int64_t hi) {
    if (!has(k)) return def;
    const json& v = j_[k];
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      fail(std::string(k) + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + v.dump());
    return v.get<int64_t>();
  }
  bool boolean(const char* k, bool def) {
    if (!has(k)) return def;
    if (!j_[k].is_boolean()) fail(std::string(k) + " must be true or false, got " + j_[k].dump());
    return j_[k].get<bool>();
  }
  std::string text(const char* k, const std::string& def) {
    if (!has(k)) return def;
    if (!j_[k].is_string()) fail(std::string(k) + " must be a string, got " + j_[k].dump());
    return j_[k].get<std::string>();
  }
  // Every key was read: anything else is a typo.
  void done() const {
    for (const auto& [k, v] : j_.items())
      if (!seen_.count(k)) {
        const std::vector<std::string> known(seen_.begin(), seen_.end());
        fail("unknown key \"" + k + "\"" + suggestion(k, known) + " (known here: " + join(known) + ")");
      }
  }

 private:
  static std::string num(double v) {
    std::ostringstream o;
    o << v;
    return o.str();
  }
  const json& j_;
  std::string where_;
  std::set<std::string> seen_;
};

LinkSpec parse_link(const json& j, const std::string& where, LinkSpec l) {
  Fields f(j, where);
  const double both = f.number("gbps", -1, 1e-6, 1e4);
  if (both > 0) l.up_bps = l.down_bps = both * 1e9;
  l.up_bps = f.number("up_gbps", l.up_bps / 1e9, 1e-6, 1e4) * 1e9;
  l.down_bps = f.number("down_gbps", l.down_bps / 1e9, 1e-6, 1e4) * 1e9;
  l.latency_s = f.number("latency_ms", l.latency_s * 1e3, 0, 1e5) / 1e3;
  f.done();
  return l;
}

Profile parse_profile(const json& j, const std::string& where, const std::map<std::string, Profile>& known) {
  Fields f(j, where);
  Profile p;
  const std::string base = f.text("base", "");
  if (!base.empty()) {
    auto it = known.find(base);
    if (it == known.end()) f.fail("base \"" + base + "\" is not a profile; use one of a100, v100, t4, cpu or one defined above");
    p = it->second;
  }
  p.flops = f.number("tflops", p.flops / 1e12, 0, 1e6) * 1e12;
  p.mem_bytes_per_s = f.number("mem_gbytes_per_s", p.mem_bytes_per_s / 1e9, 1e-3, 1e6) * 1e9;
  if (f.has("memory_gib")) p.memory_bytes = int64_t(f.number("memory_gib", 0, 0, 1e6) * double(1ull << 30));
  p.cuda = f.boolean("cuda", p.cuda);
  p.precision = f.text("precision", p.precision);
  if (p.precision != "fp32" && p.precision != "bf16" && p.precision != "fp16") f.fail("precision must be fp32, bf16 or fp16");
  p.jitter = f.number("jitter", p.jitter, 0, 10);
  p.overhead_ms = f.number("overhead_ms", p.overhead_ms, 0, 1e6);
  p.load_s = f.number("load_s", p.load_s, 0, 1e6);
  p.ms_per_unit = f.number("ms_per_unit", p.ms_per_unit, 0, 1e9);
  p.on_stage = int(f.integer("on_stage", p.on_stage, -1, limits::kMaxStages - 1));
  f.done();
  if (!(p.flops > 0) && !(p.ms_per_unit > 0)) throw ScenarioError(where + ": give tflops or ms_per_unit (a measured profile), or a base");
  if (!(p.mem_bytes_per_s > 0)) throw ScenarioError(where + ": give mem_gbytes_per_s, or a base");
  return p;
}

FaultEvent parse_event(const json& j, const std::string& where) {
  Fields f(j, where);
  FaultEvent e;
  const std::string kind = f.text("kind", "");
  static const std::map<std::string, FaultEvent::Kind> kinds = {
      {"stall", FaultEvent::Kind::kStall},         {"slow", FaultEvent::Kind::kSlow},
      {"corrupt", FaultEvent::Kind::kCorrupt},     {"lie", FaultEvent::Kind::kLie},
      {"kill_stage", FaultEvent::Kind::kKillStage}, {"crash", FaultEvent::Kind::kCrash},
      {"restart_router", FaultEvent::Kind::kRestartRouter}};
  auto it = kinds.find(kind);
  if (it == kinds.end()) f.fail("kind must be one of stall, slow, corrupt, lie, kill_stage, crash, restart_router; got \"" + kind + "\"");
  e.kind = it->second;
  e.at_s = f.number("at_s", 0, 0, 1e9);
  e.peers = int(f.integer("peers", 1, 1, int64_t(limits::kMaxPeers)));
  e.group = f.text("group", "");
  e.stage = int(f.integer("stage", -1, -1, limits::kMaxStages - 1));
  e.for_s = f.number("for_s", e.kind == FaultEvent::Kind::kRestartRouter ? 3.0 : 10.0, 0, 1e9);
  e.factor = f.number("factor", 4, 1, 1e6);
  e.probability = f.number("probability", 1, 0, 1);
  e.how = f.text("how", "wrong_shape");
  if (e.kind == FaultEvent::Kind::kLie && e.how != "wrong_shape" && e.how != "bad_inputs" && e.how != "fast_claims")
    f.fail("how must be wrong_shape, bad_inputs or fast_claims");
  e.rejoin_after_s = f.number("rejoin_after_s", -1, -1, 1e9);
  if (e.kind == FaultEvent::Kind::kKillStage && e.stage < 0) f.fail("kill_stage needs the stage");
  f.done();
  return e;
}

// The data files of the job, when every one is a readable regular file.
bool data_at_hand(const JobSpec& spec) {
  if (spec.data.paths.empty()) return false;
  for (const std::string& p : spec.data.paths) {
    struct stat st{};
    if (p.empty() || ::stat(p.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  }
  return true;
}

json read_json_file(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) throw ScenarioError(what + ": cannot read \"" + path + "\"");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw ScenarioError(what + ": \"" + path + "\" is not JSON: " + e.what());
  }
}

std::string resolve(const std::string& dir, const std::string& p) {
  if (p.empty() || p[0] == '/' || dir.empty()) return p;
  return (std::filesystem::path(dir) / p).lexically_normal().string();
}

}  // namespace

int Scenario::total_peers() const {
  int n = 0;
  for (const auto& g : groups) n += g.count;
  return n;
}

Scenario parse_scenario(const json& j, const std::string& dir) {
  Fields f(j, "scenario");
  Scenario s;
  s.dir = dir;
  s.name = f.text("name", "scenario");
  s.seed = uint64_t(f.integer("seed", 1, 0, int64_t(1) << 62));
  s.duration_s = f.number("duration_s", 3600, 0.001, 1e8);
  s.sample_s = f.number("sample_s", 60, 0.001, 1e8);
  s.submit_s = f.number("submit_s", -1, -1, 1e8);
  s.trace_logs = f.boolean("trace_logs", false);
  s.tick_s = f.number("tick_ms", 5, 0.1, 1000) / 1000.0;

  // The job: a file (relative to the scenario) or an object, with an optional patch on top.
  if (!f.has("job")) f.fail("job is required: a job spec file or object (docs/job-spec.md)");
  std::string job_dir = dir;
  if (f.at("job").is_string()) {
    const std::string path = resolve(dir, f.at("job").get<std::string>());
    s.job_json = read_json_file(path, "job");
    job_dir = std::filesystem::path(path).parent_path().string();
  } else {
    s.job_json = f.at("job");
  }
  if (f.has("job_patch")) s.job_json.merge_patch(f.at("job_patch"));
  if (s.job_json.contains("data") && s.job_json["data"].is_object() && s.job_json["data"].contains("path")) {
    json& p = s.job_json["data"]["path"];
    if (p.is_string()) p = resolve(job_dir, p.get<std::string>());
    if (p.is_array())
      for (auto& e : p)
        if (e.is_string()) e = resolve(job_dir, e.get<std::string>());
  }
  try {
    s.job = parse_job_spec(s.job_json, /*check_files=*/false);
  } catch (const InputError& e) {
    throw ScenarioError(std::string("job: ") + e.what());
  }
  s.synthetic_data = !data_at_hand(s.job);
  const JobCosts costs = job_costs(s.job);

  std::map<std::string, Profile> profiles;
  for (const std::string& n : builtin_profile_names()) profiles[n] = *builtin_profile(n);
  if (f.has("profiles")) {
    Fields pf(f.at("profiles"), "profiles");
    for (const auto& [name, pj] : f.at("profiles").items()) {
      pf.has(name.c_str());
      Profile p = parse_profile(pj, "profiles." + name, profiles);
      p.name = name;
      if (p.on_stage >= s.job.partition.stages) throw ScenarioError("profiles." + name + ": on_stage is outside the job's stages");
      profiles[name] = p;
    }
  }

  if (f.has("router")) {
    Fields rf(f.at("router"), "router");
    if (rf.has("link")) s.router_link = parse_link(rf.at("link"), "router.link", s.router_link);
    s.heartbeat_ms = int(rf.integer("heartbeat_ms", 500, 10, 60000));
    s.liveness = int(rf.integer("liveness", 3, 1, 100));
    s.state_dir = rf.boolean("state_dir", false);
    rf.done();
  }

  if (!f.has("peers") || !f.at("peers").is_array() || f.at("peers").empty()) f.fail("peers must be a non-empty array of peer groups");
  const int S = s.job.partition.stages;
  for (size_t i = 0; i < f.at("peers").size(); ++i) {
    const std::string where = "peers[" + std::to_string(i) + "]";
    Fields gf(f.at("peers")[i], where);
    PeerGroup g;
    g.count = int(gf.integer("count", 1, 1, int64_t(limits::kMaxPeers)));
    const json& pj = gf.has("profile") ? gf.at("profile") : json("cpu");
    if (pj.is_string()) {
      auto it = profiles.find(pj.get<std::string>());
      if (it == profiles.end()) gf.fail("profile \"" + pj.get<std::string>() + "\" is not known; use a100, v100, t4, cpu or one under \"profiles\"");
      g.device = it->second;
      g.profile = it->first;
    } else {
      g.device = parse_profile(pj, where + ".profile", profiles);
      g.profile = g.device.name = "custom";
    }
    if (g.device.on_stage >= S) gf.fail("profile's on_stage is outside the job's stages");
    g.device = costs.calibrate(g.device);
    g.name = gf.text("name", g.profile + std::to_string(i));
    if (gf.has("link")) g.link = parse_link(gf.at("link"), where + ".link", g.link);
    g.listen = gf.boolean("listen", true);
    g.says_memory = gf.boolean("says_memory", true);
    g.has_data = gf.boolean("data", true);
    g.stage = int(gf.integer("stage", -1, -1, S - 1));
    if (gf.has("prefer_stages")) {
      const json& r = gf.at("prefer_stages");
      if (!r.is_array() || r.size() != 2 || !r[0].is_number_integer() || !r[1].is_number_integer() || r[0].get<int>() < 0 ||
          r[1].get<int>() < r[0].get<int>() || r[1].get<int>() >= S)
        gf.fail("prefer_stages must be [first, last] with 0 <= first <= last < " + std::to_string(S));
      g.prefer_lo = r[0].get<int>();
      g.prefer_hi = r[1].get<int>();
    }
    const int prefer = int(gf.integer("prefer_stage", -1, -1, S - 1));
    if (prefer >= 0) g.prefer_lo = g.prefer_hi = prefer;
    if (g.stage >= 0 && g.prefer_lo >= 0) gf.fail("give stage (pinned) or prefer_stage(s), not both");
    g.join_s = gf.number("join_s", 0, 0, 1e8);
    g.join_spread_s = gf.number("join_spread_s", 0, 0, 1e8);
    gf.done();
    s.groups.push_back(std::move(g));
  }
  if (s.total_peers() > int(limits::kMaxPeers))
    f.fail("the swarm has " + std::to_string(s.total_peers()) + " peers; a router takes at most " + std::to_string(limits::kMaxPeers));

  if (f.has("faults")) {
    Fields ff(f.at("faults"), "faults");
    s.faults.crash_per_hour = ff.number("crash_per_hour", 0, 0, 3600);
    s.faults.rejoin_after_s = ff.number("rejoin_after_s", 60, 0, 1e8);
    if (ff.has("events")) {
      if (!ff.at("events").is_array()) ff.fail("events must be an array");
      for (size_t i = 0; i < ff.at("events").size(); ++i) {
        FaultEvent e = parse_event(ff.at("events")[i], "faults.events[" + std::to_string(i) + "]");
        if (e.stage >= S) throw ScenarioError("faults.events[" + std::to_string(i) + "]: stage is outside the job's stages");
        s.faults.events.push_back(std::move(e));
      }
      std::stable_sort(s.faults.events.begin(), s.faults.events.end(), [](const FaultEvent& a, const FaultEvent& b) { return a.at_s < b.at_s; });
    }
    ff.done();
  }

  if (f.has("expect")) {
    Fields ef(f.at("expect"), "expect");
    if (ef.has("job")) s.expect.job = ef.text("job", "");
    if (ef.has("lost")) s.expect.lost = uint64_t(ef.integer("lost", 0, 0, int64_t(1) << 53));
    if (ef.has("min_tokens_per_s")) s.expect.min_tokens_per_s = ef.number("min_tokens_per_s", 0, 0, 1e15);
    if (ef.has("min_vs_ideal")) s.expect.min_vs_ideal = ef.number("min_vs_ideal", 0, 0, 10);
    if (ef.has("paused")) s.expect.paused = ef.boolean("paused", false);
    if (ef.has("min_moves")) s.expect.min_moves = uint64_t(ef.integer("min_moves", 0, 0, int64_t(1) << 53));
    if (ef.has("min_quarantined")) s.expect.min_quarantined = uint64_t(ef.integer("min_quarantined", 0, 0, int64_t(1) << 53));
    if (ef.has("min_rounds")) s.expect.min_rounds = uint64_t(ef.integer("min_rounds", 0, 0, int64_t(1) << 53));
    if (ef.has("max_timeouts")) s.expect.max_timeouts = uint64_t(ef.integer("max_timeouts", 0, 0, int64_t(1) << 53));
    ef.done();
  }
  f.done();
  return s;
}

Scenario load_scenario(const std::string& path) {
  const json j = read_json_file(path, "scenario");
  return parse_scenario(j, std::filesystem::path(path).parent_path().string());
}

}  // namespace swarm::sim
