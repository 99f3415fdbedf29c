// stage_main.cpp: swarm-stage, a stage server (see stages/stage_server.h and README's CLI section).
#include <csignal>
#include <map>

#include <CLI/CLI.hpp>

#include "runtime/errors.h"
#include "runtime/fault.h"
#include "runtime/log.h"
#include "stages/stage_server.h"

namespace {
std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }

// --fault-plan's faults first, then each --fault; the seed: --fault-seed, else the plan's, else 1.
// Returns false (after saying what is wrong) on a bad spec or plan.
bool collect_faults(const std::string& plan_path, const std::vector<std::string>& specs, CLI::Option* seed_opt,
                    uint64_t seed, swarm::StageOptions& opt) {
  try {
    if (!plan_path.empty()) {
      swarm::FaultPlan plan = swarm::load_fault_plan(plan_path);
      opt.faults = plan.faults;
      opt.fault_seed = plan.seed;
    }
    for (const auto& s : specs) opt.faults.push_back(swarm::parse_fault(s));
  } catch (const swarm::InputError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return false;
  }
  if (seed_opt->count()) opt.fault_seed = seed;
  return true;
}
}  // namespace

int main(int argc, char** argv) {
  swarm::StageOptions opt;
  std::string emulate;
  CLI::App app{"swarm-stage: serves one stage of the model for a swarm-router"};
  app.add_option("--router", opt.router, "router endpoint, tcp://HOST:PORT")->required();
  app.add_option("--stage", opt.stage, "stage to serve, pinned: the router never moves it (default: the router chooses)");
  app.add_option("--prefer-stage", opt.prefer_stage,
                 "stage to start on without pinning it: the router's rebalancer may move it (ignored with --stage)");
  app.add_option("--device", opt.device, "cpu, cuda or cuda:N")->capture_default_str();
  std::string precision = "auto";
  app.add_option("--precision", precision,
                 "compute type unless the job pins model.precision: auto (bf16 on compute capability >= 8.0, fp16 on "
                 "older GPUs, fp32 on the CPU), fp32, bf16, fp16")
      ->capture_default_str();
  app.add_option("--threads", opt.threads, "compute threads (0: libtorch's default)")->capture_default_str();
  app.add_option("--emulate", emulate,
                 "act as a slower device: a factor (e.g. 4) or a profile: a100 (1), v100 (2), t4 (4), cpu-slow (8)");
  app.add_option("--name", opt.name, "name shown by `swarm peers` (default host:pid)");
  app.add_flag("--echo", opt.echo, "answer FORWARD with its input untouched (transport benchmark)");
  app.add_option("--listen", opt.listen,
                 "take other peers' fetches here, e.g. tcp://0.0.0.0:6000 (with --advertise) or tcp://10.0.0.5:*; without it this "
                 "peer's tensors are relayed through the router");
  app.add_option("--advertise", opt.advertise,
                 "the address other peers dial, tcp://HOST:PORT, when it differs from --listen's (NAT, a wildcard bind)");
  bool no_listen = false;
  app.add_flag("--no-listen", no_listen, "take no connections from other peers (relayed through the router); the default");
  app.add_option("--fetch-timeout-s", opt.fetch_timeout_s, "a tensor not fetched from its holder in this long fails its hop (sooner where the router asks: fetch_within_ms)")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--data-root", opt.data_root,
                 "as the first or last stage, read a job's data files under this directory and sample the hops' tokens and "
                 "targets here when they match the router's copy (the router then sends none); default: the router sends them");
  size_t hold_mb = opt.hold_bytes >> 20;
  app.add_option("--hold-mb", hold_mb, "tensors kept for other peers at most [MiB]")->capture_default_str()->check(CLI::Range(1, 1 << 24));
  double memory_mb = -1;
  app.add_option("--memory-mb", memory_mb,
                 "use at most this much of the device's memory [MiB]: the router places by it, and the affinity cache keeps the "
                 "forward graphs that fit in it (default: all that is free)")
      ->check(CLI::Range(1.0, 1e9));
  app.add_option("--heartbeat-ms", opt.heartbeat_ms, "heartbeat interval")->capture_default_str();
  app.add_option("--http", opt.http,
                 "serve this server's /metrics (Prometheus) on HOST:PORT, e.g. 0.0.0.0:9100 or 127.0.0.1:0 for a free port; the "
                 "router lists it in `swarm peers` and /api/targets (default: off)");
  std::string log_format = "text";
  app.add_option("--log-format", log_format, "text (for people) or json (one object per line, for log collectors)")
      ->capture_default_str();
  std::vector<std::string> fault_specs;
  std::string fault_plan;
  uint64_t fault_seed = 1;
  app.add_option("--fault", fault_specs,
                 "inject a fault, ACTION[,key=value...], e.g. crash,after=20 or slow,factor=10 (repeatable; docs/faults.md)")
      ->allow_extra_args(false);
  app.add_option("--fault-plan", fault_plan, "inject the faults of a plan file {\"seed\": N, \"faults\": [...]}");
  CLI::Option* seed_opt = app.add_option("--fault-seed", fault_seed, "seed of the faults' random draws (default: the plan's, else 1)");
  app.add_option("--key", opt.key_file, "this server's keypair (`swarm keygen --out NAME` makes NAME.key); turns CURVE on");
  app.add_option("--router-key", opt.router_key, "the router's public key, or its .pub file (with --key)");
  CLI11_PARSE(app, argc, argv);
  opt.hold_bytes = hold_mb << 20;
  if (memory_mb > 0) opt.memory_limit_bytes = int64_t(memory_mb * double(1 << 20));
  try {
    swarm::set_log_format(swarm::parse_log_format(log_format));
  } catch (const swarm::InputError& e) {
    std::fprintf(stderr, "--log-format: %s\n", e.what());
    return 2;
  }
  if (no_listen && !opt.listen.empty()) {
    std::fprintf(stderr, "--no-listen and --listen contradict each other; give one\n");
    return 2;
  }
  if (!collect_faults(fault_plan, fault_specs, seed_opt, fault_seed, opt)) return 2;
  try {
    opt.precision = swarm::parse_precision(precision);
  } catch (const swarm::InputError& e) {
    std::fprintf(stderr, "--precision: %s\n", e.what());
    return 2;
  }
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
