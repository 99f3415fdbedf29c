// bench_common.h: what the `swarm bench` files share: a scratch
// folder, one output line, the bundled example's job, a whole swarm run to its end, and its
// training throughput, and a process's or thread's CPU time (tools/bench_common.cpp). Defines
// swarm::temp_dir, emit, example_job, run_swarm, train_tokens_per_s, cpu_seconds.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/chaos_plan.h"
#include "runtime/job_spec.h"

namespace swarm {

// A new folder /tmp/swarm-bench-WHAT-XXXXXX for a run's logs.
std::string temp_dir(const char* what);
// `line` as one JSON line under --json, else `text`.
void emit(bool as_json, const nlohmann::json& line, const std::string& text);
// examples/tiny_gpt/job.json, as JSON to adjust.
nlohmann::json example_job();
// Runs `spec` on a fresh local swarm (peers_per_stage peers of `threads` threads per stage) to
// its end and returns the final status; throws unless the job is done. resume: a checkpoint
// (step-N directory) the job continues from, as `swarm submit --resume`. chaos: a plan run from
// the job's submission on (the status gets "chaos_actions", how many it took).
nlohmann::json run_swarm(const JobSpec& spec, int threads, const char* what, int peers_per_stage = 1,
                         const std::string& resume = "", const ChaosPlan* chaos = nullptr,
                         const std::vector<std::string>& stage_args = {});   // passed to every stage server
// Tokens/s of the training steps, from a status's history (its last train-loss entry).
double train_tokens_per_s(const nlohmann::json& status);
// User + system CPU seconds from a /proc stat file: a process's (/proc/PID/stat) or one of its
// threads' (/proc/PID/task/TID/stat); 0 when it cannot be read (the process is gone).
double cpu_seconds(const std::string& stat_path);

// `swarm bench quality` (tools/bench_quality.cpp).
int bench_quality(bool as_json);

}  // namespace swarm
