// bench_common.cpp: what the `swarm bench` files share (tools/bench_common.h).
#include "tools/bench_common.h"

#include <unistd.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "runtime/client.h"
#include "tools/local_swarm.h"

namespace swarm {

using nlohmann::json;

std::string temp_dir(const char* what) {
  std::string tmpl = std::string("/tmp/swarm-bench-") + what + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back(0);
  return mkdtemp(buf.data()) ? std::string(buf.data()) : std::string("/tmp");
}

void emit(bool as_json, const json& line, const std::string& text) {
  if (as_json) std::cout << line.dump() << std::endl;
  else std::cout << text << std::endl;
}

// The bundled example's job spec, as JSON to adjust.
json example_job() {
  const std::string path = std::string(SWARM_SOURCE_DIR) + "/examples/tiny_gpt/job.json";
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return json::parse(ss.str());
}

// Tokens/s of the training steps (the final round and evaluation excluded).
double train_tokens_per_s(const json& st) {
  double tps = 0;
  for (const auto& h : st["history"])
    if (h.contains("train_loss")) tps = h.value("tokens_per_s", 0.0);
  return tps;
}

json run_swarm(const JobSpec& spec, int threads, const char* what, int peers_per_stage, const std::string& resume, const ChaosPlan* chaos,
               const std::vector<std::string>& stage_args) {
  LocalSwarm swarm(temp_dir(what));
  swarm.start_router();
  for (int s = 0; s < spec.partition.stages; ++s)
    for (int i = 0; i < peers_per_stage; ++i) swarm.start_stage(s, "stage" + std::to_string(s) + "-" + std::to_string(i), threads, stage_args);
  Client c(swarm.router_endpoint());
  json body{{"spec", to_json(spec)}};
  if (!resume.empty()) body["resume"] = resume;
  json rep = c.request_body(wire::MsgType::kSubmit, body);
  if (chaos) swarm.run_chaos(*chaos);
  FollowOptions fo;
  fo.quiet = true;
  fo.timeout_s = 900;
  json st = follow_job(c, rep.at("job_id").get<uint64_t>(), fo);
  if (chaos) st["chaos_actions"] = swarm.chaos_log().size();
  swarm.stop_all();
  if (st.value("state", std::string()) != "done") throw std::runtime_error(std::string(what) + " swarm failed: " + st.value("reason", std::string()));
  return st;
}

double cpu_seconds(const std::string& stat_path) {
  std::ifstream f(stat_path);
  std::string line;
  if (!std::getline(f, line)) return 0;
  const size_t close = line.rfind(')');   // after "pid (comm) ": the command may hold spaces
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  double utime = 0, stime = 0;
  for (int k = 3; k <= 15 && rest >> field; ++k) {   // fields 14 and 15 of proc(5)
    if (k == 14) utime = std::atof(field.c_str());
    if (k == 15) stime = std::atof(field.c_str());
  }
  return (utime + stime) / double(sysconf(_SC_CLK_TCK));
}

}  // namespace swarm
