// bench_quality.cpp: `swarm bench quality`: how well the swarm trains at equal tokens against
// one process (docs/schedules.md).
//
// Defines swarm::bench_quality. The bundled example (300 steps, seed 1, the same samples in the
// same order) trained by `swarm reference` (one process, plain AdamW) and by fresh local swarms:
// the default schedule with 2 peers per stage (fp32); the same with int8 activations and
// gradients and a peer killed every 15 s (examples/chaos/kill_every_15s.json), DiLoCo as the
// job's defaults have it; `sync` with 1 and with 2 peers per stage; and the first asynchronous
// schedule (`async_local`, 2 peers per stage) for comparison. Each case's line carries its loss
// curve, so tools/plot_schedules.py draws them against tokens. Then the two schedules' tokens/s
// once more with peers that do not contend for the cores (every peer emulating a device 8x
// slower than its CPU share: --emulate 8 sleeps for the rest), in steady training.
#include <algorithm>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "runtime/chaos_plan.h"
#include "runtime/data.h"
#include "runtime/job_spec.h"
#include "stages/reference.h"
#include "tools/bench_common.h"

namespace swarm {

using nlohmann::json;

namespace {

struct QualityCase {
  const char* name;
  const char* schedule;  // "" leaves the job spec's default
  int peers;             // per stage
  const char* codec;     // activations and activation gradients
  bool chaos;
};

// The status's training curve: [tokens, train loss] per step and [tokens, val loss] per evaluation.
json curves(const json& st, const JobSpec& spec) {
  const double tokens_per_step = double(spec.batch.batch_size) * spec.model.seq_len;
  json train = json::array(), val = json::array();
  for (const auto& h : st["history"]) {
    if (!h.contains("step")) continue;
    const double tokens = h["step"].get<double>() * tokens_per_step;
    if (h.contains("train_loss") && h["train_loss"].is_number()) train.push_back({tokens, h["train_loss"]});
    if (h.contains("val_loss") && h["val_loss"].is_number()) val.push_back({tokens, h["val_loss"]});
  }
  return {{"train", train}, {"val", val}};
}

// Tokens/s of `schedule` on 2 peers per stage that each act as a device of their own: with 8
// peers on 2 cores both schedules keep the cores about 93% busy, so the quality runs' ratio of
// tokens/s measures the cores; here a peer computes an eighth of the time and sleeps the rest
// (--emulate 8), so the schedules differ in how busy they keep the peers. Steady training:
// 60 steps, no warm start, no evaluation.
double emulated_tokens_per_s(json j, const char* schedule) {
  j["schedule"] = schedule;
  j["steps"] = 60;
  j["diloco"]["warm_start_steps"] = 0;
  j["eval"]["every_steps"] = 0;
  const JobSpec spec = parse_job_spec(j, true);
  return train_tokens_per_s(run_swarm(spec, 1, (std::string("emulated-") + schedule).c_str(), 2, "", nullptr, {"--emulate", "8"}));
}

}  // namespace

int bench_quality(bool as_json) {
  const QualityCase cases[] = {{"async", "", 2, "fp32", false},
                               {"full_stack", "", 2, "int8", true},
                               {"sync1", "sync", 1, "fp32", false},
                               {"sync2", "sync", 2, "fp32", false},
                               {"async_local", "async_local", 2, "fp32", false}};
  const json base = example_job();
  JobSpec ref_spec = parse_job_spec(base, true);
  const double tokens_per_step = double(ref_spec.batch.batch_size) * ref_spec.model.seq_len;
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  TokenData data = TokenData::load(ref_spec.data, ref_spec.model.seq_len, ref_spec.model.vocab_size);
  json ref_train = json::array();
  ReferenceResult ref = train_reference(ref_spec, data, cores, [&](int step, double loss) {
    ref_train.push_back({double(step) * tokens_per_step, loss});
  });
  json raw = json::object();
  raw["reference"] = {{"val_loss", ref.val_loss}, {"tokens_per_s", ref.tokens_per_s}, {"steps", ref_spec.steps},
                      {"curve", {{"train", ref_train}, {"val", json::array({json::array({ref_spec.steps * tokens_per_step, ref.val_loss})})}}}};
  json line{{"bench", "quality"}, {"case", "reference"}};
  line.update(raw["reference"]);
  emit(as_json, line, "reference (one process, plain AdamW): val loss " + std::to_string(ref.val_loss));

  const ChaosPlan plan = load_chaos_plan(std::string(SWARM_SOURCE_DIR) + "/examples/chaos/kill_every_15s.json");
  for (const QualityCase& cs : cases) {
    json j = base;
    if (*cs.schedule) j["schedule"] = cs.schedule;
    j["compression"]["activations"] = cs.codec;
    j["compression"]["gradients"] = cs.codec;
    const JobSpec spec = parse_job_spec(j, true);
    const json st = run_swarm(spec, 1, cs.name, cs.peers, "", cs.chaos ? &plan : nullptr);
    const double val = st["val_loss"].get<double>();
    raw[cs.name] = {{"schedule", schedule_name(spec.schedule)}, {"peers_per_stage", cs.peers}, {"codec", cs.codec},
                    {"chaos", cs.chaos ? "kill_every_15s" : ""}, {"warm_start_steps", spec.diloco.warm_start_steps},
                    {"val_loss", val}, {"loss_rel", val / ref.val_loss - 1.0}, {"tokens_per_s", train_tokens_per_s(st)},
                    {"elapsed_s", st["elapsed_s"]}, {"rounds", st["rounds"]}, {"microbatches", st["microbatches"]},
                    {"sync_bytes_per_sample", st.value("sync_bytes_per_sample", 0.0)},
                    {"chaos_actions", st.value("chaos_actions", 0)}, {"curve", curves(st, spec)}};
    char text[256];
    std::snprintf(text, sizeof(text), "%-12s %-11s %d peer(s)/stage, %-4s%s: val loss %.4f (%+.2f%% vs one process), %.0f tokens/s",
                  cs.name, schedule_name(spec.schedule), cs.peers, cs.codec, cs.chaos ? ", chaos" : "", val,
                  100 * (val / ref.val_loss - 1.0), train_tokens_per_s(st));
    json line{{"bench", "quality"}, {"case", cs.name}};
    line.update(raw[cs.name]);
    emit(as_json, line, text);
  }
  for (const char* s : {"async", "sync"}) {
    const double tps = emulated_tokens_per_s(base, s);
    raw[std::string("emulated_") + s] = {{"schedule", s}, {"peers_per_stage", 2}, {"emulate", 8}, {"steps", 60}, {"tokens_per_s", tps}};
    json line{{"bench", "quality"}, {"case", std::string("emulated_") + s}};
    line.update(raw[std::string("emulated_") + s]);
    emit(as_json, line, std::string("emulated_") + s + ": " + std::to_string(tps) + " tokens/s (every peer --emulate 8, 60 steps, no warm start)");
  }
  auto rel = [&](const char* c) { return raw[c]["loss_rel"].get<double>(); };
  auto tps = [&](const char* c) { return raw[c]["tokens_per_s"].get<double>(); };
  json lost = raw["full_stack"]["microbatches"].value("lost", json(0));
  json summary{{"bench", "quality"},
               {"figures", {{"async_loss_rel", {{"value", rel("async")}, {"target", "<= 0.03"}}},
                            {"full_stack_loss_rel", {{"value", rel("full_stack")}, {"target", "<= 0.03"}}},
                            {"sync1_loss_rel", {{"value", rel("sync1")}, {"target", "<= 0.005"}}},
                            {"async_vs_sync_tokens", {{"value", tps("async") / tps("sync2")}, {"target", ">= 1.1"}}},
                            {"async_vs_sync_tokens_emulated", {{"value", tps("emulated_async") / tps("emulated_sync")}, {"target", "report"}}},
                            {"sync2_loss_rel", {{"value", rel("sync2")}, {"target", "report"}}},
                            {"async_local_loss_rel", {{"value", rel("async_local")}, {"target", "report"}}},
                            {"full_stack_lost", {{"value", lost}, {"target", "0"}}}}},
               {"raw", raw}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

}  // namespace swarm
