// swarm_main.cpp: `swarm`, the user's CLI: local, submit, status, peers, cancel, bench, reference,
// export.
//
// Every subcommand that talks to a router goes through swarm::Client (runtime/client.h), so
// a dead router address is a clear message, not a hang. `swarm local` starts a whole swarm on
// this machine (tools/local_swarm.h) and follows the job to its end.
#include <unistd.h>

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
#include "compression/codec.h"
#include "stages/export.h"
#include "stages/reference.h"
#include "tools/bench.h"
#include "tools/local_swarm.h"

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"swarm: train one model across many unreliable, unequal machines"};
  app.require_subcommand(1);

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
  bench->add_option("name", bench_name, "codec | compression | transport | pipeline | diloco | faults | hetero | hosts | gpu")->required();
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

  CLI11_PARSE(app, argc, argv);

  try {
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
      swarm.start_router();
      for (int s = 0; s < spec.partition.stages; ++s)
        for (int i = 0; i < peers_per_stage; ++i)
          swarm.start_stage(s, "stage" + std::to_string(s) + "-" + std::to_string(i), threads,
                            {"--device", device, "--precision", precision});
      if (!as_json)
        std::cout << "swarm: router at " << swarm.router_endpoint() << ", " << n << " stage servers ("
                  << spec.partition.stages << " stages x " << peers_per_stage << "), logs in " << log_dir << std::endl;
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
      swarm.stop_all();
      return print_final(st, as_json);
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
        std::printf("%-16s %-20s %-6s %-8s %-8s %-7s %-7s %-10s %-8s %s\n", "ID", "NAME", "STAGE", "STATE", "DEVICE", "MEMORY", "FREE",
                    "MS/UNIT", "HOPS", "EMULATED");
        // GiB, "-" when the peer did not say (FREE: free when it said HELLO, before it loaded a stage).
        auto gib = [](const json& p, const char* key) {
          const json v = p.value(key, json(nullptr));
          char text[32] = "-";
          if (v.is_number()) std::snprintf(text, sizeof(text), "%.1fG", v.get<double>() / double(1 << 30));
          return std::string(text);
        };
        for (const auto& p : rep["peers"]) {
          // HOPS: "direct" when other peers fetch its tensors from it, "relayed" when they go through the router.
          std::printf("%-16s %-20s %-6d %-8s %-8s %-7s %-7s %-10.2f %-8s %s\n", p["id"].get<std::string>().c_str(), p["name"].get<std::string>().c_str(),
                      p["stage"].get<int>(), p["state"].get<std::string>().c_str(), p.value("device_name", p["device"].get<std::string>()).c_str(),
                      gib(p, "device_memory_bytes").c_str(), gib(p, "device_memory_free_bytes").c_str(), p["ms_per_unit"].get<double>(),
                      p.value("relayed", true) ? "relayed" : "direct",
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
      json rep = c.request_body(wire::MsgType::kChaos, json{{"peer", peer_id}, {"fault", fault_text}});
      std::cout << "fault " << rep.value("fault", fault_text) << " sent to peer " << rep.value("name", peer_id) << " (" << rep.value("peer", std::string()) << ")" << std::endl;
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
  } catch (const std::exception& e) {
    std::cerr << "swarm: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
