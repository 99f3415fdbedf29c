// stage_main.cpp: swarm-stage, a stage server (see stages/stage_server.h and README's CLI section).
#include <csignal>
#include <map>

#include <CLI/CLI.hpp>

#include "runtime/log.h"
#include "stages/stage_server.h"

namespace {
std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }
}  // namespace

int main(int argc, char** argv) {
  swarm::StageOptions opt;
  std::string emulate;
  CLI::App app{"swarm-stage: serves one stage of the model for a swarm-router"};
  app.add_option("--router", opt.router, "router endpoint, tcp://HOST:PORT")->required();
  app.add_option("--stage", opt.stage, "stage to serve (default: the router chooses)");
  app.add_option("--device", opt.device, "cpu, cuda or cuda:N")->capture_default_str();
  app.add_option("--threads", opt.threads, "compute threads (0: libtorch's default)")->capture_default_str();
  app.add_option("--emulate", emulate,
                 "act as a slower device: a factor (e.g. 4) or a profile: a100 (1), v100 (2), t4 (4), cpu-slow (8)");
  app.add_option("--name", opt.name, "name shown by `swarm peers` (default host:pid)");
  app.add_flag("--echo", opt.echo, "answer FORWARD with its input untouched (transport benchmark)");
  app.add_option("--heartbeat-ms", opt.heartbeat_ms, "heartbeat interval")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (!emulate.empty()) {
    // Rough relative speeds of these devices on small-transformer training, slowest last.
    static const std::map<std::string, double> profiles = {{"a100", 1.0}, {"v100", 2.0}, {"t4", 4.0}, {"cpu-slow", 8.0}};
    auto it = profiles.find(emulate);
    if (it != profiles.end()) {
      opt.emulate = it->second;
      opt.profile = emulate;
    } else {
      try {
        opt.emulate = std::stod(emulate);
      } catch (...) {
        opt.emulate = 0;
      }
      if (!(opt.emulate >= 1.0)) {
        std::fprintf(stderr, "--emulate %s: give a factor >= 1 or one of a100, v100, t4, cpu-slow\n", emulate.c_str());
        return 2;
      }
    }
  }
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  try {
    return swarm::run_stage_server(opt, g_stop);
  } catch (const std::exception& e) {
    swarm::log_error("stage", e.what());
    return 1;
  }
}
