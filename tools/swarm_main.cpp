// swarm_main.cpp: `swarm`, the user's CLI: local, submit, status, peers, cancel, bench, reference,
// export, sim.
//
// Every subcommand that talks to a router goes through swarm::Client (runtime/client.h), so
// a dead router address is a clear message, not a hang. `swarm local` starts a whole swarm on
// this machine (tools/local_swarm.h) and follows the job to its end.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>

#include "runtime/client.h"
#include "runtime/data.h"
#include "runtime/chaos_plan.h"
#include "runtime/fault.h"
#include "runtime/job_spec.h"
#include "runtime/http.h"
#include "runtime/keys.h"
#include "runtime/log.h"
#include "compression/codec.h"
#include "stages/export.h"
#include "stages/reference.h"
#include "tools/bench.h"
#include "tools/conformance.h"
#include "tools/local_swarm.h"
#include "tools/sim_cli.h"

using nlohmann::json;
using namespace swarm;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw SpecError("cannot read job spec file '" + path + "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Parses and validates a job spec file, codecs included (parse_job_spec checks them): every
// mistake is reported here, before anything starts.
JobSpec load_spec(const std::string& path) { return parse_job_spec_text(read_file(path), /*check_files=*/true); }

uint64_t submit(Client& c, const JobSpec& spec, const std::string& resume = "") {
  json body{{"spec", to_json(spec)}};
  if (!resume.empty()) body["resume"] = std::filesystem::absolute(resume).string();
  json rep = c.request_body(wire::MsgType::kSubmit, body);
  return rep.at("job_id").get<uint64_t>();
}

int print_final(const json& st, bool as_json) {
  json done = done_event(st);
  if (as_json) {
    std::cout << done.dump() << std::endl;
  } else {
    const auto& mb = done["microbatches"];
    std::cout << "job " << done["job_id"] << " " << done["state"].get<std::string>()
              << (done["reason"].get<std::string>().empty() ? "" : ": " + done["reason"].get<std::string>()) << "\n"
              << "  steps " << done["steps"] << ", train loss " << done["train_loss"] << ", val loss " << done["val_loss"]
              << " (unigram baseline " << done["unigram_loss"] << ")\n"
              << "  " << done["tokens_per_s"] << " tokens/s over " << done["elapsed_s"] << " s\n"
              << "  microbatches: " << mb.dump() << "\n"
              << "  backward: " << done["backward"].dump() << ", wire bytes: " << done["wire_bytes"].dump() << std::endl;
  }
  return st.value("state", std::string()) == "done" ? 0 : 1;
}

int hardware_threads() { return std::max(1, int(std::thread::hardware_concurrency())); }

std::atomic<bool> g_interrupted{false};
void on_interrupt(int) { g_interrupted = true; }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"swarm: train one model across many unreliable, unequal machines"};
  app.require_subcommand(1);
  app.fallthrough();   // --key, --router-key and --log-format may come after the subcommand
  std::string key_file, router_key;
  app.add_option("--key", key_file, "your keypair for a router that uses keys (default: $SWARM_KEY)");
  app.add_option("--router-key", router_key, "the router's public key or .pub file (default: $SWARM_ROUTER_KEY)");
  std::string log_format = "text";
  app.add_option("--log-format", log_format,
                 "text (for people) or json (one object per line, for log collectors); `swarm local` passes it to its processes")
      ->capture_default_str();

  std::string keygen_out;
  auto* keygen = app.add_subcommand("keygen", "make a keypair: NAME.key (secret, mode 0600) and NAME.pub (docs/security.md)");
  keygen->add_option("--out", keygen_out, "NAME: the files to write (NAME.key, NAME.pub); never overwritten")->required();

  // swarm local
  std::string job_path, router, log_dir, resume, chaos_path, peer_id, fault_text;
  std::string device = "cpu", precision = "auto";
  int peers_per_stage = 2, threads = 0;
  bool as_json = false, follow = false;
  auto* local = app.add_subcommand("local", "run a whole swarm on this machine: a router and stage servers on loopback");
  local->add_option("job", job_path, "job spec (JSON)")->required();
  local->add_option("--peers-per-stage", peers_per_stage, "stage servers per stage")->capture_default_str()->check(CLI::Range(1, 64));
  local->add_option("--threads", threads, "compute threads per stage server (0: cores / servers)");
  local->add_option("--log-dir", log_dir, "where the processes' logs go (default: a new folder under /tmp)");
  local->add_option("--chaos", chaos_path, "kill, stop and restart peers on a seeded schedule (docs/faults.md, examples/chaos/)");
  local->add_option("--device", device, "the stage servers' device: cpu, cuda or cuda:N (all share it)")->capture_default_str();
  local->add_option("--precision", precision, "the stage servers' --precision: auto, fp32, bf16, fp16 (the job's model.precision wins)")
      ->capture_default_str();
  local->add_flag("--json", as_json, "one JSON object per line");
  std::string http = "127.0.0.1:0";
  local->add_option("--http", http,
                    "where the router serves the dashboard and /metrics (HOST:PORT; the default picks a free loopback port; "
                    "\"off\" for none)")
      ->capture_default_str();
  bool keep_running = false;
  local->add_flag("--keep-running", keep_running, "after the job ends, keep the swarm and its dashboard up until Ctrl-C");

  auto* chaos = app.add_subcommand("chaos", "inject a fault into a live peer (docs/faults.md)");
  chaos->add_option("--router", router, "router endpoint")->required();
  chaos->add_option("--peer", peer_id, "the peer's id or name (see `swarm peers`)")->required();
  chaos->add_option("--fault", fault_text, "fault spec, e.g. slow,factor=10 or crash,after=20")->required();

  auto* sub = app.add_subcommand("submit", "submit a job to a running router");
  sub->add_option("job", job_path, "job spec (JSON)")->required();
  sub->add_option("--router", router, "router endpoint, tcp://HOST:PORT")->required();
  sub->add_option("--resume", resume, "continue from the newest valid checkpoint in this directory (or this step-N directory)");
  sub->add_flag("--follow", follow, "follow the job to its end");
  sub->add_flag("--json", as_json, "one JSON object per line");

  uint64_t job_id = 0;
  auto* status = app.add_subcommand("status", "show a job's status (the latest job by default)");
  status->add_option("--router", router, "router endpoint")->required();
  status->add_option("--job", job_id, "job id");
  status->add_flag("--json", as_json, "print JSON");

  auto* peers = app.add_subcommand("peers", "list the router's stage servers");
  peers->add_option("--router", router, "router endpoint")->required();
  peers->add_flag("--json", as_json, "print JSON");

  auto* cancel = app.add_subcommand("cancel", "cancel a job");
  cancel->add_option("--router", router, "router endpoint")->required();
  cancel->add_option("job_id", job_id, "job id")->required();

  std::string bench_name;
  auto* bench = app.add_subcommand("bench", "measure one thing against a reference in the same run (docs/benchmarks.md)");
  bench->add_option("name", bench_name, "codec | compression | transport | pipeline | diloco | faults | hetero | hosts | quality | sim | router | gpu")->required();
  bench->add_flag("--json", as_json, "JSON lines, the last one the summary");

  auto* ref = app.add_subcommand("reference", "train the job in one process (the oracle the swarm is checked against)");
  ref->add_option("job", job_path, "job spec (JSON)")->required();
  ref->add_option("--threads", threads, "compute threads (0: libtorch's default)");
  ref->add_option("--device", device, "cpu, cuda or cuda:N")->capture_default_str();
  ref->add_option("--precision", precision, "auto, fp32, bf16, fp16 (the job's model.precision wins)")->capture_default_str();
  int ref_steps = 0;
  ref->add_option("--steps", ref_steps, "train this many steps instead of the job's (the learning-rate schedule is the job's)");
  ref->add_flag("--json", as_json, "JSON lines");

  std::string ckpt_path, export_out;
  auto* exp = app.add_subcommand("export", "write a checkpoint's global weights as a PyTorch state dict (docs/checkpoints.md)");
  exp->add_option("checkpoint", ckpt_path, "a checkpoint dir (its newest valid step) or a step-* dir")->required();
  exp->add_option("--out", export_out, "the state dict to write (.pt); the model config goes beside it as .json")->required();
  exp->add_flag("--json", as_json, "print JSON");

  std::string scenario_path;
  std::optional<uint64_t> sim_seed;
  auto* simc = app.add_subcommand("sim", "simulate a swarm in virtual time: the router's real core, simulated peers, links and faults (docs/scale.md)");
  simc->add_option("scenario", scenario_path, "scenario (JSON; examples/sim/)")->required();
  simc->add_option("--seed", sim_seed, "seed for every random draw (default: the scenario's)");
  simc->add_flag("--json", as_json, "JSON lines: the trace, then the summary, then the core's CPU figures");
  int sim_threads = 0;
  simc->add_option("--threads", sim_threads, "1: the router's side and the peers' interleaved on one thread; 2: on two (default: two where the links' latency allows; the trace is the same)")
      ->check(CLI::Range(0, 2));
  ConformanceOptions conf;
  auto* conform = app.add_subcommand("conformance", "check a stage server against the peer contract, message by message (docs/model.md)");
  conform->add_option("--peer", conf.peer_command, "the peer's command; {router} becomes the kit's endpoint, e.g. 'build/swarm-stage --router {router}'")
      ->required();
  conform->add_option("--stage", conf.stage, "the stage of the 3-stage test job it serves")->capture_default_str()->check(CLI::Range(0, 2));
  conform->add_option("--reference", conf.reference_command, "the reference peer's command (default: swarm-stage beside this binary)");
  conform->add_option("--timeout-s", conf.reply_timeout_s, "a request unanswered this long fails its check")->capture_default_str();
  conform->add_option("--log-dir", conf.log_dir, "where the two peers' logs go (default: a new folder under /tmp)");
  conform->add_flag("--json", as_json, "one JSON object per check, then a summary line");

  CLI11_PARSE(app, argc, argv);
  if (!key_file.empty()) setenv("SWARM_KEY", key_file.c_str(), 1);
  if (!router_key.empty()) setenv("SWARM_ROUTER_KEY", router_key.c_str(), 1);
  try {
    set_log_format(parse_log_format(log_format));
  } catch (const InputError& e) {
    std::cerr << "swarm: --log-format: " << e.what() << std::endl;
    return 2;
  }

  try {
    if (*keygen) {
      const KeyPair k = generate_keypair();
      write_keypair(keygen_out, k);
      std::cout << "wrote " << keygen_out << ".key (secret: keep it on this host) and " << keygen_out << ".pub\n"
                << "public key: " << k.public_key << "\n"
                << "on the router, allow it with a line in the --authorized file:\n  " << k.public_key << " ROLE "
                << std::filesystem::path(keygen_out).filename().string() << "   (ROLE: stage, client or admin)" << std::endl;
      return 0;
    }
    if (*conform) {
      size_t failed = 0;
      std::vector<ConformanceCheck> checks;
      try {
        checks = run_conformance(conf, [&](const ConformanceCheck& c) {
        failed += !c.ok;
        if (as_json) std::cout << json{{"check", c.name}, {"ok", c.ok}, {"detail", c.detail}}.dump() << std::endl;
        else std::cout << (c.ok ? "PASS " : "FAIL ") << c.name << ": " << c.detail << std::endl;
        });
      } catch (const InputError& e) {
        throw SpecError(e.what());
      }
      if (as_json) {
        std::cout << json{{"conformance", {{"stage", conf.stage}, {"checks", checks.size()}, {"passed", checks.size() - failed}, {"failed", failed}}}}.dump()
                  << std::endl;
      } else {
        std::cout << (failed ? "conformance: FAILED " : "conformance: passed ") << checks.size() - failed << " of " << checks.size() << " checks" << std::endl;
      }
      return failed || checks.empty() ? 1 : 0;
    }
    if (*local) {
      JobSpec spec = load_spec(job_path);
      const int n = spec.partition.stages * peers_per_stage;
      if (threads <= 0) threads = std::max(1, hardware_threads() / n);
      if (log_dir.empty()) {
        char tmpl[] = "/tmp/swarm-local-XXXXXX";
        log_dir = mkdtemp(tmpl) ? tmpl : "/tmp";
      }
      LocalSwarm swarm(log_dir);
      std::optional<ChaosPlan> plan;
      if (!chaos_path.empty()) {
        try {
          plan = load_chaos_plan(chaos_path);
        } catch (const InputError& e) {
          throw SpecError(std::string("--chaos: ") + e.what());
        }
        swarm.set_stage_faults(*plan);
      }
      try {
        parse_precision(precision);
      } catch (const InputError& e) {
        throw SpecError(std::string("--precision: ") + e.what());
      }
      if (http != "off") {
        try {
          http::parse_bind(http);
        } catch (const InputError& e) {
          throw SpecError(std::string("--http: ") + e.what());
        }
      }
      swarm.set_log_format(log_format);
      // Jobs read data from the working directory down and from the folders of the data this
      // job names (docs/security.md).
      std::vector<std::string> router_args = {"--data-root", std::filesystem::current_path().string()};
      for (const std::string& p : spec.data.paths) {
        const std::string folder = std::filesystem::absolute(p).parent_path().string();
        if (std::find(router_args.begin(), router_args.end(), folder) == router_args.end())
          router_args.insert(router_args.end(), {"--data-root", folder});
      }
      if (http != "off") router_args.insert(router_args.end(), {"--http", http});
      swarm.start_router(router_args);
      // The stage servers serve their own /metrics on the router's HTTP host, each on a free port;
      // the router lists them in /api/targets for Prometheus.
      std::vector<std::string> stage_args{"--device", device, "--precision", precision};
      if (http != "off") stage_args.insert(stage_args.end(), {"--http", http::parse_bind(http).first + ":0"});
      for (int s = 0; s < spec.partition.stages; ++s)
        for (int i = 0; i < peers_per_stage; ++i)
          swarm.start_stage(s, "stage" + std::to_string(s) + "-" + std::to_string(i), threads, stage_args);
      if (as_json) {
        json started{{"event", "started"}, {"router", swarm.router_endpoint()}, {"stage_servers", n}, {"log_dir", log_dir},
                     {"key", log_dir + "/keys/admin.key"}, {"router_key", log_dir + "/keys/router.pub"}};
        started["dashboard"] = swarm.http_url().empty() ? json(nullptr) : json(swarm.http_url() + "/");
        started["metrics"] = swarm.http_url().empty() ? json(nullptr) : json(swarm.http_url() + "/metrics");
        std::cout << started.dump() << std::endl;
      } else {
        std::cout << "swarm: router at " << swarm.router_endpoint() << ", " << n << " stage servers ("
                  << spec.partition.stages << " stages x " << peers_per_stage << "), logs in " << log_dir << std::endl
                  << "swarm: its keys: swarm --key " << log_dir << "/keys/admin.key --router-key " << log_dir
                  << "/keys/router.pub status --router " << swarm.router_endpoint() << std::endl;
        if (!swarm.http_url().empty())
          std::cout << "swarm: dashboard at " << swarm.http_url() << "/ (Prometheus metrics at " << swarm.http_url() << "/metrics)"
                    << std::endl;
      }
      Client c(swarm.router_endpoint());
      const uint64_t id = submit(c, spec);
      if (plan) {
        swarm.run_chaos(*plan, [&](const ChaosRecord& r) {
          if (as_json) std::cout << to_json(r).dump() << std::endl;
          else std::cout << "chaos: " << r.action << " " << r.peer << (r.note.empty() ? "" : " (" + r.note + ")") << std::endl;
        });
      }
      FollowOptions fo;
      fo.json = as_json;
      json st = follow_job(c, id, fo);
      swarm.stop_chaos();
      const int rc = print_final(st, as_json);
      if (keep_running) {
        // The job is over; its figures, dashboard and metrics stay up for a look.
        std::signal(SIGINT, on_interrupt);
        std::signal(SIGTERM, on_interrupt);
        if (as_json) std::cout << json{{"event", "staying_up"}, {"router", swarm.router_endpoint()}}.dump() << std::endl;
        else std::cout << "swarm: the swarm stays up (--keep-running); Ctrl-C stops it" << std::endl;
        while (!g_interrupted) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      swarm.stop_all();
      return rc;
    }
    if (*sub) {
      JobSpec spec = load_spec(job_path);
      Client c(router);
      const uint64_t id = submit(c, spec, resume);
      if (!follow) {
        std::cout << (as_json ? json{{"event", "submitted"}, {"job_id", id}}.dump() : "submitted job " + std::to_string(id)) << std::endl;
        return 0;
      }
      FollowOptions fo;
      fo.json = as_json;
      return print_final(follow_job(c, id, fo), as_json);
    }
    if (*status) {
      Client c(router);
      json body = json::object();
      if (job_id) body["job_id"] = job_id;
      json st = c.request_body(wire::MsgType::kStatus, body);
      if (as_json) {
        std::cout << st.dump() << std::endl;
      } else {
        st.erase("history");
        std::cout << st.dump(2) << std::endl;
      }
      return 0;
    }
    if (*peers) {
      Client c(router);
      json rep = c.peers();
      if (as_json) {
        std::cout << rep.dump() << std::endl;
      } else {
        std::printf("%-16s %-20s %-6s %-8s %-8s %-7s %-7s %-6s %-10s %-8s %-9s %s\n", "ID", "NAME", "STAGE", "STATE", "DEVICE", "MEMORY", "FREE",
                    "CACHE", "MS/UNIT", "HOPS", "LINK", "EMULATED");
        // GiB (MiB under one GiB: a --memory-mb cap), "-" when the peer did not say (FREE: free
        // when it said HELLO, before it loaded a stage).
        auto gib = [](const json& p, const char* key) {
          const json v = p.value(key, json(nullptr));
          char text[32] = "-";
          if (v.is_number()) {
            const double b = v.get<double>();
            if (b < double(1 << 30)) std::snprintf(text, sizeof(text), "%.0fM", b / double(1 << 20));
            else std::snprintf(text, sizeof(text), "%.1fG", b / double(1 << 30));
          }
          return std::string(text);
        };
        for (const auto& p : rep["peers"]) {
          // HOPS: "direct" when other peers fetch its tensors from it, "relayed" when they go through the router.
          // CACHE: the forward graphs its affinity cache may keep for its stage ("-" before one is loaded).
          const json entries = p["heartbeat"].value("cache_entries", json(nullptr));
          const std::string cache = entries.is_number() ? std::to_string(entries.get<int64_t>()) : "-";
          // LINK: the pace the router has timed its tensors coming at, in Mbit/s ("-": not timed yet).
          const json pace = p.value("s_per_mb", json(nullptr));
          char link[32] = "-";
          if (pace.is_number() && pace.get<double>() > 0) std::snprintf(link, sizeof(link), "%.3gMb/s", 8.0 / pace.get<double>());
          std::printf("%-16s %-20s %-6d %-8s %-8s %-7s %-7s %-6s %-10.2f %-8s %-9s %s\n", wire::printable_id(wire::id_from_json(p["id"])).c_str(), p["name"].get<std::string>().c_str(),
                      p["stage"].get<int>(), p["state"].get<std::string>().c_str(), p.value("device_name", p["device"].get<std::string>()).c_str(),
                      gib(p, "device_memory_bytes").c_str(), gib(p, "device_memory_free_bytes").c_str(), cache.c_str(), p["ms_per_unit"].get<double>(),
                      p.value("relayed", true) ? "relayed" : "direct", link,
                      p["emulate"].get<double>() > 1 ? (p["profile"].get<std::string>().empty() ? (std::to_string(p["emulate"].get<double>()) + "x").c_str() : p["profile"].get<std::string>().c_str()) : "-");
        }
      }
      return 0;
    }
    if (*chaos) {
      try {
        parse_fault(fault_text);
      } catch (const InputError& e) {
        throw SpecError(std::string("--fault: ") + e.what());
      }
      Client c(router);
      // An id `swarm peers` printed as 0x + hex (not printable) goes back as its bytes (msgpack bin).
      const std::optional<std::string> raw_id = wire::id_from_hex(peer_id);
      json rep = c.request_body(wire::MsgType::kChaos, json{{"peer", raw_id ? wire::id_json(*raw_id) : json(peer_id)}, {"fault", fault_text}});
      std::cout << "fault " << rep.value("fault", fault_text) << " sent to peer " << rep.value("name", peer_id) << " ("
                << wire::printable_id(wire::id_from_json(rep.value("peer", json()))) << ")" << std::endl;
      return 0;
    }
    if (*cancel) {
      Client c(router);
      json st = c.request_body(wire::MsgType::kCancel, json{{"job_id", job_id}});
      std::cout << "job " << job_id << ": " << st.value("state", std::string()) << std::endl;
      return 0;
    }
    if (*bench) {
      return run_bench(bench_name, as_json);
    }
    if (*simc) return run_sim(scenario_path, as_json, sim_seed, sim_threads);
    if (*exp) {
      try {
        const ExportSummary r = export_checkpoint(ckpt_path, export_out);
        if (as_json) {
          std::cout << json{{"event", "exported"}, {"checkpoint", r.checkpoint}, {"step", r.step}, {"state_dict", r.pt_path},
                            {"config", r.config_path}, {"tensors", r.tensors}, {"parameters", r.parameters}}.dump()
                    << std::endl;
        } else {
          std::cout << "exported " << r.checkpoint << " (step " << r.step << ")\n  " << r.pt_path << ": " << r.tensors
                    << " tensors, " << r.parameters << " parameters (float32 state dict, torch.load)\n  " << r.config_path
                    << ": model config" << std::endl;
        }
        return 0;
      } catch (const InputError& e) {   // a missing, damaged or mismatched checkpoint: bad input
        std::cerr << "swarm export: " << e.what() << std::endl;
        return 2;
      }
    }
    if (*ref) {
      JobSpec spec = load_spec(job_path);
      if (ref_steps < 0) throw SpecError("--steps must be >= 0 (0: the job's)");
      const int steps = ref_steps > 0 ? std::min(ref_steps, spec.steps) : spec.steps;
      ReferenceOptions ro;
      ro.threads = threads;
      ro.device = device;
      ro.max_steps = steps;
      try {
        ro.precision = parse_precision(precision);
      } catch (const InputError& e) {
        throw SpecError(std::string("--precision: ") + e.what());
      }
      TokenData data = TokenData::load(spec.data, spec.model.seq_len, spec.model.vocab_size);
      ReferenceResult r;
      try {
        r = train_reference(spec, data, ro, [&](int step, double loss) {
          if (as_json) std::cout << json{{"event", "step"}, {"step", step + 1}, {"train_loss", loss}}.dump() << std::endl;
          else std::cout << "step " << step + 1 << "/" << steps << "  loss " << loss << std::endl;
        });
      } catch (const InputError& e) {
        throw SpecError(e.what());
      }
      json done{{"event", "done"}, {"steps", steps}, {"losses", r.losses}, {"val_loss", r.val_loss},
                {"unigram_loss", data.unigram_loss()}, {"tokens_per_s", r.tokens_per_s}};
      std::cout << (as_json ? done.dump() : done.dump(2)) << std::endl;
      return 0;
    }
  } catch (const SpecError& e) {
    std::cerr << "swarm: " << e.what() << std::endl;
    return 2;
  } catch (const RouterUnreachable& e) {
    std::cerr << "swarm: " << e.what() << std::endl;
    return 3;
  } catch (const RouterError& e) {
    std::cerr << "swarm: the router refused: " << e.what() << std::endl;
    return 2;
  } catch (const InputError& e) {   // a key file, a flag: bad input
    std::cerr << "swarm: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "swarm: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
